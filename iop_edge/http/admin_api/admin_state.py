"""The admin API's reads of the Edge's live state: liveness, readiness, status, the
catalog and its summary, activity, principals and Prometheus metrics (design §10)."""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from iop_edge.core.catalog_query import CatalogQuery, CatalogQueryError
from iop_edge.core.routing.readiness import NO_SERVABLE_MODEL
from iop_edge.http.admin_api.admin_answers import error_response, json_response
from iop_edge.http.admin_api.admin_services import AdminServices
from iop_edge.http.admin_api.catalog_stream import catalog_chunks, catalog_summary


def add_state_routes(app: QuartTrio, services: AdminServices) -> None:
    """Serve the reads of the Edge's live state."""

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness: the process answers (and which config revision runs)."""
        return json_response({"status": "ok", "revision": services.revision()})

    @app.get("/readyz")
    async def readyz() -> Response:
        """Readiness (design §12): 200 only when some model could be served now."""
        state = services.readiness()
        body = {
            "status": "ready" if state.ready else "not_ready",
            "revision": services.revision(),
            "servable_models": state.servable_models,
            "models": state.models,
        }
        if not state.ready:
            reason = state.reason or NO_SERVABLE_MODEL
            body["reason"] = f"{reason} (see /catalog)" if reason == NO_SERVABLE_MODEL else reason
        return json_response(body, 200 if state.ready else 503)

    @app.get("/activity")
    async def activity() -> Response:
        """Requests and errors per 10 s over the last 5 minutes, for the pool page."""
        return json_response(services.activity())

    @app.get("/status")
    async def status() -> Response:
        return json_response(services.status())

    @app.get("/catalog")
    async def catalog() -> Response:
        """`?model=&node=&health=` filter, `?limit=&cursor=` page (`core.catalog_query`);
        the answer is written as it is built, in slices (`catalog_stream`)."""
        try:
            query = CatalogQuery.from_arguments(request.args.to_dict())
        except CatalogQueryError as exc:
            return error_response(400, str(exc))
        return Response(catalog_chunks(services.catalog, query), content_type="application/json")

    @app.get("/catalog/summary")
    async def catalog_summary_() -> Response:
        """Providers counted by health, and how many models and Nodes: the pool page's
        headline for a fleet too large to list at once."""
        return json_response(await catalog_summary(services.catalog))

    @app.get("/principals")
    async def principals() -> Response:
        """Each principal against its limits: in flight, queued, what is left of each
        limit, today's tokens (the pool page shows it)."""
        if services.principals is None:
            return error_response(404, "this Edge does not report principals")
        return json_response(services.principals())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(services.metrics(), content_type="text/plain; version=0.0.4; charset=utf-8")
