"""check_image against a real Registry v2 (Debian's docker-registry) holding images this test pushes.

Three registries: anonymous, Basic (htpasswd) and token auth (the registry's own bearer flow with
tests/support/registry.TokenService as the realm). Each failure mode is asserted on its type and on
the message naming wanted vs found.
"""

from __future__ import annotations

import base64
import json

import pytest

from tasks.images import (
    ImageNotFoundError,
    ImageRequirements,
    LabelCheckError,
    PlatformMismatchError,
    RegistryAuthError,
    RegistryCredentials,
    check_image,
    docker_config_credentials,
    parse_reference,
    swr_login_credentials,
)
from tests.support.registry import PASSWORD, USER, Registry, TokenService

NPU_LABELS = {"org.vimeflow.vllm-ascend": "0.11.0", "org.vimeflow.cann": "8.3.RC2",
              "org.vimeflow.torch": "2.7.1", "org.opencontainers.image.revision": "abc123"}
AMD64_LABELS = {"org.vimeflow.vllm": "0.33.0", "org.vimeflow.torch": "2.14.0"}


@pytest.fixture(scope="module")
def token_service():
    service = TokenService()
    yield service
    service.close()


@pytest.fixture(scope="module")
def registries(tmp_path_factory, token_service):
    """The three registries, each holding the same images, pushed through the API."""
    base = tmp_path_factory.mktemp("registries")
    regs = {}
    try:
        regs["none"] = Registry(base / "none")
        regs["htpasswd"] = Registry(base / "htpasswd", auth="htpasswd")
        regs["token"] = Registry(base / "token", auth="token", token_service=token_service)
        token_service.swr_registry_host = regs["token"].host
        for reg in regs.values():
            reg.digests = {}
            reg.digests["npu"], _ = reg.push_image("vimeflow/npu", "v1", architecture="arm64", labels=NPU_LABELS)
            reg.digests["cuda"], _ = reg.push_image("vimeflow/cuda", "v1", architecture="amd64", labels=AMD64_LABELS)
            arm, arm_entry = reg.push_image("vimeflow/multi", None, architecture="arm64", labels=NPU_LABELS)
            amd, amd_entry = reg.push_image("vimeflow/multi", None, architecture="amd64", labels=AMD64_LABELS)
            reg.digests.update(multi_arm64=arm, multi_amd64=amd,
                               multi=reg.push_index("vimeflow/multi", "v1", [amd_entry, arm_entry]))
        yield regs
    finally:
        for reg in regs.values():
            reg.close()


ASCEND = ImageRequirements(architecture="aarch64", label_constraints=["org.vimeflow.vllm-ascend >= 0.9",
                                                                      "org.vimeflow.torch == 2.7.1"])


# ---------------------------------------------------------------- anonymous registry


def test_single_arch_image_passes_and_reports_digest_platform_labels(registries):
    reg = registries["none"]
    info = check_image(f"{reg.host}/vimeflow/npu:v1", ASCEND)
    assert info.digest == info.manifest_digest == reg.digests["npu"]
    assert info.platform == "linux/arm64"
    assert info.labels == NPU_LABELS
    assert info.tag == "v1" and info.repository == "vimeflow/npu" and info.config_digest.startswith("sha256:")


def test_wrong_architecture_names_wanted_and_found(registries):
    with pytest.raises(PlatformMismatchError) as err:
        check_image(f"{registries['none'].host}/vimeflow/cuda:v1", ImageRequirements(architecture="arm64"))
    assert "wanted platform linux/arm64" in str(err.value) and "found linux/amd64" in str(err.value)


def test_index_resolves_to_the_wanted_platform(registries):
    reg = registries["none"]
    arm = check_image(f"{reg.host}/vimeflow/multi:v1", ImageRequirements(architecture="arm64"))
    amd = check_image(f"{reg.host}/vimeflow/multi:v1", ImageRequirements(architecture="x86_64"))
    assert arm.digest == amd.digest == reg.digests["multi"]
    assert (arm.manifest_digest, arm.platform, arm.labels) == (reg.digests["multi_arm64"], "linux/arm64", NPU_LABELS)
    assert (amd.manifest_digest, amd.platform, amd.labels) == (reg.digests["multi_amd64"], "linux/amd64",
                                                               AMD64_LABELS)


def test_index_without_the_wanted_platform_lists_what_is_there(registries):
    with pytest.raises(PlatformMismatchError) as err:
        check_image(f"{registries['none'].host}/vimeflow/multi:v1", ImageRequirements(architecture="ppc64le"))
    message = str(err.value)
    assert "wanted platform linux/ppc64le" in message
    assert "linux/amd64" in message and "linux/arm64" in message


def test_reference_by_digest(registries):
    reg = registries["none"]
    info = check_image(f"{reg.host}/vimeflow/npu@{reg.digests['npu']}", ASCEND)
    assert info.digest == reg.digests["npu"] and info.tag is None


@pytest.mark.parametrize("ref, missing", [("vimeflow/npu:v9", "tag"), ("vimeflow/nothing:v1", "repository")])
def test_missing_tag_or_repository(registries, ref, missing):
    with pytest.raises(ImageNotFoundError) as err:
        check_image(f"{registries['none'].host}/{ref}", ASCEND)
    assert f"{missing} not found" in str(err.value) and ref.split(":")[0] in str(err.value)
    if missing == "tag":
        assert "wanted tag v9, found tags: v1" in str(err.value)


def test_missing_digest(registries):
    absent = "sha256:" + "0" * 64
    with pytest.raises(ImageNotFoundError, match="digest not found"):
        check_image(f"{registries['none'].host}/vimeflow/npu@{absent}", ASCEND)


def test_label_checks_name_each_difference(registries):
    req = ImageRequirements(architecture="arm64",
                            label_constraints=["org.vimeflow.vllm-ascend >= 0.12", "org.vimeflow.cann >= 8.2rc1",
                                               "org.vimeflow.mindspeed >= 2.2"],
                            labels={"org.opencontainers.image.revision": "def456",
                                    "org.vimeflow.torch": "2.7.1"})
    with pytest.raises(LabelCheckError) as err:
        check_image(f"{registries['none'].host}/vimeflow/npu:v1", req)
    failures = err.value.failures
    assert failures == [
        "org.vimeflow.vllm-ascend: wanted >= 0.12, found 0.11.0",
        "org.vimeflow.mindspeed: wanted >= 2.2, found no such label",
        "org.opencontainers.image.revision: wanted == 'def456', found 'abc123'",
    ]  # cann 8.3.RC2 >= 8.2rc1 and torch == 2.7.1 passed


def test_version_comparison_is_numeric_not_textual(registries):
    # "0.11.0" < "0.9" as text; as versions it is greater.
    info = check_image(f"{registries['none'].host}/vimeflow/npu:v1",
                       ImageRequirements(label_constraints=["org.vimeflow.vllm-ascend > 0.9", "org.vimeflow.vllm-ascend == 0.11"]))
    assert info.labels["org.vimeflow.vllm-ascend"] == "0.11.0"


# ---------------------------------------------------------------- Basic auth (htpasswd)


def _docker_config(tmp_path, host: str, user: str, password: str):
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return path


def test_basic_auth_with_docker_config(registries, tmp_path):
    reg = registries["htpasswd"]
    config = _docker_config(tmp_path, reg.host, USER, PASSWORD)
    info = check_image(f"{reg.host}/vimeflow/multi:v1", ASCEND, docker_config=config)
    assert info.manifest_digest == reg.digests["multi_arm64"]


def test_basic_auth_without_credentials(registries, tmp_path):
    with pytest.raises(RegistryAuthError, match="requires credentials"):
        check_image(f"{registries['htpasswd'].host}/vimeflow/npu:v1", ASCEND, docker_config=tmp_path / "none.json")


def test_basic_auth_wrong_password_keeps_it_out_of_the_message(registries):
    wrong = "not-the-password-42"
    with pytest.raises(RegistryAuthError) as err:
        check_image(f"{registries['htpasswd'].host}/vimeflow/npu:v1", ASCEND,
                    credentials=RegistryCredentials(USER, wrong))
    assert "refused the given credentials" in str(err.value)
    assert wrong not in str(err.value) and wrong not in repr(err.value)


# ---------------------------------------------------------------- bearer token auth


def test_bearer_flow_with_explicit_credentials(registries, token_service):
    reg = registries["token"]
    token_service.scopes_requested.clear()
    info = check_image(f"{reg.host}/vimeflow/multi:v1", ASCEND, credentials=RegistryCredentials(USER, PASSWORD))
    assert info.manifest_digest == reg.digests["multi_arm64"] and info.labels == NPU_LABELS
    # one token for the whole check: manifest list, manifest and config blob reuse it
    assert token_service.scopes_requested == ["repository:vimeflow/multi:pull"]


def test_bearer_flow_anonymous_is_refused(registries, tmp_path):
    with pytest.raises(RegistryAuthError, match="refused anonymous access"):
        check_image(f"{registries['token'].host}/vimeflow/npu:v1", ASCEND, docker_config=tmp_path / "none.json")


def test_bearer_flow_wrong_password(registries):
    with pytest.raises(RegistryAuthError, match="token service .* refused") as err:
        check_image(f"{registries['token'].host}/vimeflow/npu:v1", ASCEND,
                    credentials=RegistryCredentials(USER, "wrong-pw-17"))
    assert "wrong-pw-17" not in str(err.value)


def test_bearer_flow_with_docker_config_finds_wrong_tag(registries, tmp_path):
    reg = registries["token"]
    config = _docker_config(tmp_path, reg.host, USER, PASSWORD)
    with pytest.raises(ImageNotFoundError, match="tag not found"):
        check_image(f"{reg.host}/vimeflow/npu:v2", ASCEND, docker_config=config)


def test_swr_temporary_login_through_the_sdk(registries, token_service):
    """huaweicloudsdkswr's CreateSecret (signed with AK/SK) → docker credentials → bearer flow."""
    reg = registries["token"]
    token_service.swr_authorizations.clear()
    creds = swr_login_credentials("AKTESTSWR0001", "sk-swr-secret", "proj-0001", "cn-north-4",
                                  endpoint=token_service.url)
    assert creds == {reg.host: RegistryCredentials(USER, PASSWORD)}
    assert token_service.swr_authorizations[0].startswith("SDK-HMAC-SHA256 Access=AKTESTSWR0001")
    info = check_image(f"{reg.host}/vimeflow/npu:v1", ASCEND, credentials=creds[reg.host])
    assert info.digest == reg.digests["npu"]


def test_swr_login_refused_is_an_auth_error(token_service):
    with pytest.raises(RegistryAuthError) as err:
        swr_login_credentials("AKWRONG", "sk-swr-secret-7", "proj-0001", "cn-north-4", endpoint=token_service.url)
    assert "SWR temporary login failed (HTTP 401, SVCSTG.SWR.4010001)" in str(err.value)
    assert "sk-swr-secret-7" not in str(err.value)


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize("text, expected", [
    ("ubuntu", ("docker.io", "library/ubuntu", None, None)),
    ("ubuntu:24.04", ("docker.io", "library/ubuntu", "24.04", None)),
    ("vllm/vllm-openai:v0.33.0", ("docker.io", "vllm/vllm-openai", "v0.33.0", None)),
    ("localhost:5000/a/b", ("localhost:5000", "a/b", None, None)),
    ("swr.cn-north-4.myhuaweicloud.com/org/vimeflow-npu:0.1.0",
     ("swr.cn-north-4.myhuaweicloud.com", "org/vimeflow-npu", "0.1.0", None)),
    ("127.0.0.1:5000/x@sha256:" + "a" * 64, ("127.0.0.1:5000", "x", None, "sha256:" + "a" * 64)),
    ("quay.io/ascend/cann:8.3.rc2-910b-ubuntu22.04-py3.11@sha256:" + "b" * 64,
     ("quay.io", "ascend/cann", "8.3.rc2-910b-ubuntu22.04-py3.11", "sha256:" + "b" * 64)),
])
def test_parse_reference(text, expected):
    ref = parse_reference(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == expected


@pytest.mark.parametrize("bad", ["Upper/Case:1", "host:5000/x@sha256:zz", "x:"])
def test_parse_reference_rejects(bad):
    with pytest.raises(ValueError):
        parse_reference(bad)


def test_requirements_reject_malformed_constraints():
    with pytest.raises(ValueError, match="not '<label> <op> <version>'"):
        ImageRequirements(label_constraints=["org.vimeflow.vllm-ascend ~ 0.9"])
    with pytest.raises(ValueError, match="is not a version"):
        ImageRequirements(label_constraints=["org.vimeflow.vllm-ascend >= latest"])


def test_docker_config_lookup_for_docker_hub(tmp_path):
    auth = base64.b64encode(b"hub-user:hub-pass").decode()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"auths": {"https://index.docker.io/v1/": {"auth": auth}}}))
    assert docker_config_credentials("docker.io", path) == RegistryCredentials("hub-user", "hub-pass")
    assert docker_config_credentials("quay.io", path) is None
    assert "hub-pass" not in repr(RegistryCredentials("hub-user", "hub-pass"))
