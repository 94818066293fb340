"""The admin API's models routes (design §10, §18): each served model's load state per
provider, and the operator's loads and unloads.

- `GET /models`: every catalog model, each provider serving it with the served name and
  the load state its runtime last reported (null where the runtime does not say).
- `POST /models/load` and `POST /models/unload` with `{"model": ..., "provider": ...}`
  (provider optional): answered once every runtime acted, with what each did. 200 when
  every provider did it, 502 when one failed, 404 for a model or provider the catalog
  does not have, 409 when no provider could take the load. Audited (`model-audit.jsonl`).
- `POST /models/pin` and `POST /models/unpin`, the same body: pin the model on the
  provider (else on the one a load would go to), loading it there, until unpinned or the
  Edge restarts; unpin the operator's pins of it (409 when there are none). Same
  answers, same audit (`runtime.models.keeper`).

Callers (principals) never reach these: the admin API is loopback-only and mutations are
refused to browsers (`admin` Rules 1-4).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from iop_edge.http.admin_api.admin_answers import error_response, json_response
from iop_edge.http.admin_api.catalog_stream import CatalogSource
from schemas.catalog import (
    ModelCommandAction,
    ModelCommandOutcome,
    ModelCommandReport,
    ModelCommandRequest,
    ModelLoadStates,
    ModelsReport,
    ProviderLoadState,
)

__all__ = ["ModelCommandRunner", "add_model_routes"]

ModelCommandRunner = Callable[
    [ModelCommandAction, ModelCommandRequest], Awaitable[ModelCommandReport]
]

_decode_request: Final = msgspec.json.Decoder(ModelCommandRequest)
#: A command request is a model id and a provider id: a few hundred bytes at most.
MAX_COMMAND_BODY: Final = 64 * 1024


#: What each outcome of a load or unload is answered with.
COMMAND_STATUS: Final[dict[ModelCommandOutcome, int]] = {
    "done": 200,
    "failed": 502,
    "unknown": 404,
    "no_provider": 409,
    "refused": 409,
}


def add_model_routes(app: QuartTrio, catalog: CatalogSource, run: ModelCommandRunner) -> None:
    """Serve the models routes on the admin `app`."""

    @app.get("/models")
    async def models() -> Response:
        snapshot = catalog.snapshot
        listed: list[ModelLoadStates] = []
        for model_id in sorted(snapshot.models):
            served = snapshot.models[model_id].providers
            providers = []
            for record in catalog.catalog_providers(sorted(served)):
                states = {state.name: state for state in record.model_states or ()}
                state = states.get(served[record.id])
                providers.append(
                    ProviderLoadState(
                        provider=record.id,
                        node=record.node_id,
                        served_model=served[record.id],
                        connected=record.connected,
                        state=None if state is None else state.state,
                        reason=None if state is None else state.reason,
                        max_loaded=record.max_loaded,
                        pinned=served[record.id] in record.pinned,
                    )
                )
            listed.append(ModelLoadStates(model=model_id, providers=providers))
        return json_response(ModelsReport(models=listed))

    async def command(action: ModelCommandAction) -> Response:
        body = await request.get_data(cache=False)
        if len(body) > MAX_COMMAND_BODY:
            return error_response(413, "request body too large")
        try:
            parsed = _decode_request.decode(body or b"{}")
        except msgspec.DecodeError as exc:
            return error_response(400, f"invalid {action} request: {exc}")
        report = await run(action, parsed)
        return json_response(report, COMMAND_STATUS[report.outcome])

    @app.post("/models/load")
    async def load() -> Response:
        return await command("load")

    @app.post("/models/unload")
    async def unload() -> Response:
        return await command("unload")

    @app.post("/models/pin")
    async def pin() -> Response:
        return await command("pin")

    @app.post("/models/unpin")
    async def unpin() -> Response:
        return await command("unpin")
