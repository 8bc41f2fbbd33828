"""Check a container image in its registry before a run downloads anything.

``check_image(reference, requirements)`` speaks the Registry v2 / OCI distribution HTTP API with httpx:
it resolves the reference (a tag or a digest) to a manifest, picks the wanted platform out of a
manifest list / OCI index, reads the image config blob for architecture and labels, and checks them
against ``ImageRequirements``. Each way of failing has its own error type, whose message names what
was wanted and what was found. Plain functions, no Prefect and no engine: the pipeline wraps them.

Auth follows the registry's ``WWW-Authenticate`` challenge, as the Docker client does: ``Basic`` gets
the credentials directly; ``Bearer realm=…,service=…,scope=…`` (Docker Hub, Harbor, SWR) gets a token
from the realm, with the credentials as basic auth when there are any. Credentials come explicitly, from
a docker ``config.json`` (``auths.<host>.auth``), or for SWR from its temporary-login API
(``swr_login_credentials``). They never appear in messages.

`registry` holds the references, credentials and the registry session; `checks` the requirements and the
check itself.
"""

from tasks.images.checks import ImageInfo, ImageRequirements, LabelConstraint, check_image, normalize_architecture
from tasks.images.registry import (
    ImageCheckError, ImageNotFoundError, ImageReference, LabelCheckError, PlatformMismatchError, RegistryAuthError,
    RegistryCredentials, RegistryError, credentials_from_auth_entry, docker_config_credentials, parse_reference,
    swr_login_credentials,
)

__all__ = [
    "ImageCheckError", "ImageInfo", "ImageNotFoundError", "ImageReference", "ImageRequirements", "LabelCheckError",
    "LabelConstraint", "PlatformMismatchError", "RegistryAuthError", "RegistryCredentials", "RegistryError",
    "check_image", "credentials_from_auth_entry", "docker_config_credentials", "normalize_architecture",
    "parse_reference", "swr_login_credentials",
]
