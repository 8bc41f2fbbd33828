"""An S3 server for the storage tests, run as a process of its own (`python -m tests.support.moto_s3_server PORT`):
moto serving S3 to every request, with OBS's create-only PUT (ObsForbidOverwrite)."""

from __future__ import annotations

import logging
import sys


class ObsForbidOverwrite:
    """OBS's create-only PUT on the S3 server moto is: a PUT with `x-obs-forbid-overwrite: true` is served as S3's
    `If-None-Match: *` and moto's refusal (412 PreconditionFailed) answered as OBS answers (409 ObjectAlreadyExists).
    moto speaks S3 only; OBS takes its own header instead of S3's."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        if environ.get("REQUEST_METHOD") != "PUT" or environ.get("HTTP_X_OBS_FORBID_OVERWRITE", "").lower() != "true":
            return self.app(environ, start_response)
        environ["HTTP_IF_NONE_MATCH"] = "*"
        answer: dict = {}

        def keep(status, headers, exc_info=None):
            answer.update(status=status, headers=headers)
            return lambda data: None

        body = b"".join(self.app(environ, keep))
        if answer["status"].startswith("412"):
            body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ObjectAlreadyExists</Code>'
                    b"<Message>The object already exists.</Message></Error>")
            start_response("409 Conflict", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        start_response(answer["status"], answer["headers"])
        return [body]


def serve_s3(port: int) -> None:
    """Serve S3 on 127.0.0.1:`port` until killed, as `moto_server s3` does, for every request.

    moto picks a request's service from the SigV4 credential scope in its Authorization header and reads an
    OBS or SigV2 header ("OBS ak:base64-signature") the same way, so a signature with exactly four '/' in it
    (about one request in 1,400) was sent to a made-up service and answered 500. A CI run failed on it."""
    from moto.moto_server.werkzeug_app import (
        DEFAULT_SERVICE_REGION,
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    service, region = DEFAULT_SERVICE_REGION
    assert service == "s3"

    class S3Dispatcher(DomainDispatcherApplication):
        def infer_service_region_host(self, environ, path):
            return f"{service}.{region}.amazonaws.com"

    app = ObsForbidOverwrite(S3Dispatcher(create_backend_app))
    make_server("127.0.0.1", port, app, True, request_handler=MotoRequestHandler).serve_forever()


if __name__ == "__main__":
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    serve_s3(int(sys.argv[1]))
