"""The Quart-Trio app: routes, error shapes, CORS and the body limit."""

from __future__ import annotations

import structlog
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from service.api import routes_admin, routes_openai
from service.api.app_state import EXTENSION_KEY, AppState
from service.api.errors import APIError, error_body, error_response, json_response
from service.api.metrics import Metrics
from service.config import Config
from service.engine.engine import Engine
from service.tokenizer import Tokenizer

log = structlog.get_logger("cadence.app")
CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Expose-Headers": "Retry-After, X-Request-Id",
}
PREFLIGHT_HEADERS = {
    **CORS_HEADERS,
    "Access-Control-Allow-Methods": "GET, POST, PUT, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Tenant",
    "Access-Control-Max-Age": "600",
}


def create_app(
    config: Config, engine: Engine, tokenizer: Tokenizer, served_model_name: str
) -> QuartTrio:
    """The HTTP front end of a running engine (service.server runs both)."""
    # Import name -> root path service/api/, so service/api/static is served at /static.
    app = QuartTrio(__name__, static_folder="static")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    # Non-streaming generations can take long too; SSE responses also set their own None.
    app.config["RESPONSE_TIMEOUT"] = None
    metrics = Metrics()
    engine.add_observer(metrics)
    app.extensions[EXTENSION_KEY] = AppState(config, engine, tokenizer, served_model_name, metrics)
    app.register_blueprint(routes_openai.blueprint)
    app.register_blueprint(routes_admin.blueprint)
    _install_page(app)
    _install_cors(app)
    _install_error_handlers(app)
    return app


def _install_page(app: QuartTrio) -> None:
    @app.get("/")
    async def page() -> Response:
        """The browser page (service/api/static/index.html), same origin as the API."""
        return await app.send_static_file("index.html")


def _install_cors(app: QuartTrio) -> None:
    @app.before_request
    async def answer_preflight() -> Response | None:
        if request.method == "OPTIONS":
            return Response(b"", 204, PREFLIGHT_HEADERS)
        return None

    @app.after_request
    async def allow_any_origin(response: Response) -> Response:
        for name, value in CORS_HEADERS.items():
            response.headers.setdefault(name, value)
        return response


def _install_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(APIError)
    async def api_error(error: APIError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        message = error.description or error.name
        if status == 413:
            message = f"the request body is larger than {app.config['MAX_CONTENT_LENGTH']} bytes"
        # An unread body stays on the connection; closing it keeps the next request sane.
        headers = {"Connection": "close"} if status == 413 else None
        return json_response(error_body(message, status, code=code), status, headers)

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        log.exception("http.error", path=request.path, error=repr(error))
        return json_response(
            error_body(f"internal error: {type(error).__name__}", 500, code="internal_error"), 500
        )
