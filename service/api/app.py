"""The Quart-Trio app: routes, error shapes, CORS, JSON-only bodies, read to their end, and the
body limit."""

from __future__ import annotations

from typing import Any

import structlog
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from service.api import (
    openapi,
    routes_admin,
    routes_anthropic,
    routes_embeddings,
    routes_lora,
    routes_openai,
    routes_responses,
    routes_tokenize,
)
from service.api.access import install_api_keys, install_host_check
from service.api.anthropic_errors import answers_anthropic, anthropic_error_body
from service.api.app_state import EXTENSION_KEY, AppState
from service.api.body import drain_unread_body
from service.api.cors import CorsPolicy
from service.api.errors import APIError, error_body, json_response
from service.api.metrics import Metrics
from service.config import Config
from service.engine import trace_context
from service.engine.adapters import AdapterRegistry
from service.engine.engine import Engine
from service.engine.grammar import GrammarCompiler, hf_tokenizer_info
from service.tokenizer import Tokenizer

log = structlog.get_logger("cadence.app")
JSON_MIMETYPE = "application/json"
METHODS_WITH_BODY = ("POST", "PUT")
PAGE_FRAMING_HEADERS = {
    "Content-Security-Policy": "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
}


def create_app(
    config: Config,
    engine: Engine,
    tokenizer: Tokenizer,
    served_model_name: str,
    adapters: AdapterRegistry | None = None,
) -> QuartTrio:
    """The HTTP front end of a running engine (service.server runs both)."""
    # Import name -> root path service/api/, so service/api/static is served at /static.
    app = QuartTrio(__name__, static_folder="static")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.config["BODY_TIMEOUT"] = config.body_timeout  # then 408: body.py closes the connection
    # Non-streaming generations can take long too; SSE responses also set their own None.
    app.config["RESPONSE_TIMEOUT"] = None
    metrics = Metrics(frozenset(key.tenant for key in config.api_keys))
    engine.add_observer(metrics)
    _install_tracing(app, config, engine, metrics, served_model_name)
    state = AppState(config, engine, tokenizer, served_model_name, metrics)
    state.adapters = adapters
    state.grammars = GrammarCompiler(lambda: _tokenizer_info(engine, tokenizer))
    app.extensions[EXTENSION_KEY] = state
    app.register_blueprint(routes_openai.blueprint)
    app.register_blueprint(routes_tokenize.blueprint)
    app.register_blueprint(routes_embeddings.blueprint)
    app.register_blueprint(routes_responses.blueprint)
    app.register_blueprint(routes_anthropic.blueprint)
    app.register_blueprint(routes_admin.blueprint)
    app.register_blueprint(routes_lora.blueprint)
    app.register_blueprint(openapi.blueprint)
    _install_page(app)
    install_host_check(app, config)
    _install_cors(app, CorsPolicy(frozenset(config.allowed_origins)))
    install_api_keys(app, config)
    _install_json_only(app)
    _install_body_drain(app)
    _install_error_handlers(app)
    return app


def _tokenizer_info(engine: Engine, tokenizer: Tokenizer) -> Any:
    """For the first response_format, which comes once the worker has told the vocab size."""
    assert engine.handshake is not None, "a grammar compiled before the worker started"
    vocab_size = engine.handshake.vocab_size
    return hf_tokenizer_info(tokenizer.backend, vocab_size, tokenizer.eos_token_ids)


def _install_tracing(
    app: QuartTrio, config: Config, engine: Engine, metrics: Metrics, model: str
) -> None:
    """Every route's caller's W3C trace context goes with what it submits; with
    --otlp-traces-endpoint, the engine's requests become spans (service.tracing)."""

    @app.before_request
    async def keep_trace_context() -> None:
        trace_context.current.set(trace_context.headers_of(request.headers.get))

    if config.otlp_traces_endpoint:
        from service.tracing.lifetime import start_tracing

        start_tracing(app, config, engine, metrics.spans_dropped.inc, model)


def _install_page(app: QuartTrio) -> None:
    @app.get("/")
    async def page() -> Response:
        """The browser page (service/api/static/index.html), same origin as the API."""
        response = await app.send_static_file("index.html")
        # Never inside another site's frame: its buttons (a long prompt, a policy swap)
        # must not be clicked through a page laid over it (clickjacking).
        response.headers.update(PAGE_FRAMING_HEADERS)
        return response


def _install_cors(app: QuartTrio, policy: CorsPolicy) -> None:
    @app.before_request
    async def answer_preflight() -> Response | None:
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or method is None:
            return None
        return policy.preflight(
            origin, request.path, method, request.headers.get("Access-Control-Request-Headers")
        )

    @app.after_request
    async def allow_configured_origins(response: Response) -> Response:
        origin = request.headers.get("Origin")
        response.headers.update(policy.response_headers(origin, request.path))
        return response


def _install_json_only(app: QuartTrio) -> None:
    @app.before_request
    async def require_json_body() -> None:
        # A browser sends text/plain, form and untyped bodies to any origin without a
        # preflight; demanding JSON keeps pages the CORS policy does not allow from driving us.
        if request.method not in METHODS_WITH_BODY or request.url_rule is None:
            return
        if not request.content_length and "Transfer-Encoding" not in request.headers:
            return  # no body at all (POST /reset_prefix_cache): nothing a page could forge
        if request.mimetype != JSON_MIMETYPE:
            raise APIError(
                415,
                f"the request body must be JSON: send 'Content-Type: {JSON_MIMETYPE}'",
                code="unsupported_media_type",
            )


def _install_body_drain(app: QuartTrio) -> None:
    @app.after_request
    async def drain_body_before_answering(response: Response) -> Response:
        if not await drain_unread_body():
            # Too large to read: the rest of it must not reach the next request.
            response.headers["Connection"] = "close"
        return response


def _install_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(APIError)
    async def api_error(error: APIError) -> Response:
        return _error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        code = {
            404: "not_found",
            405: "method_not_allowed",
            408: "request_timeout",
            413: "request_too_large",
        }.get(status)
        message = error.description or error.name
        if status == 413:
            message = f"the request body is larger than {app.config['MAX_CONTENT_LENGTH']} bytes"
        return _error_response(APIError(status, message, code=code))

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        log.exception("http.error", path=request.path, error=repr(error))
        message = f"internal error: {type(error).__name__}"
        return _error_response(APIError(500, message, code="internal_error"))


def _error_response(error: APIError) -> Response:
    """In the shape of the API the request was for: Anthropic's on its routes, else OpenAI's."""
    if answers_anthropic(request.path):
        body = anthropic_error_body(error.message, error.status)
    else:
        body = error_body(error.message, error.status, param=error.param, code=error.code)
    return json_response(body, error.status, error.headers)
