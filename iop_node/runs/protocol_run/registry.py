"""The caller protocols the Node runs, found in one place by a run's operation.

`TRANSLATORS` holds the built-in ones (Messages, Responses); `register` adds another (a
`Translator` in its own module, with the Edge's `CallerProtocol` of the same name), and
nothing else on the Node needs to know it exists. A run whose operation no translator
serves is the adapter's (`ADAPTER_OPERATIONS`: chat completions, completions,
embeddings), or refused.
"""

from __future__ import annotations

from typing import Final

from iop_node.runs.protocol_run.messages import MESSAGES
from iop_node.runs.protocol_run.responses import RESPONSES
from iop_node.runs.protocol_run.translator import Translator

__all__ = ["ADAPTER_OPERATIONS", "TRANSLATORS", "Translators"]

#: The operations an adapter runs as they are (OpenAI's requests of those names); any
#: other is a caller protocol's, run by its translator, and refused without one.
ADAPTER_OPERATIONS: Final = frozenset({"chat", "completion", "embedding"})


class Translators:
    """The registry of translators, by the operations they serve."""

    def __init__(self, *translators: Translator) -> None:
        self._by_operation: dict[str, Translator] = {}
        for translator in translators:
            self.register(translator)

    def register(self, translator: Translator) -> None:
        """Run `translator`'s operations from now on; `ValueError` when one is served."""
        taken = sorted(op for op in translator.operations if op in self._by_operation)
        taken += sorted(translator.operations & ADAPTER_OPERATIONS)
        if taken:
            raise ValueError(
                f"{', '.join(taken)}: served by another translator or by the adapters already"
            )
        for operation in translator.operations:
            self._by_operation[operation] = translator

    def unregister(self, name: str) -> None:
        """Run the protocol named `name` no more (a protocol a test registered)."""
        for operation, translator in list(self._by_operation.items()):
            if translator.name == name:
                del self._by_operation[operation]

    def of(self, operation: str) -> Translator | None:
        """The translator of a run's operation; None: the adapter runs it as it is."""
        return self._by_operation.get(operation)


TRANSLATORS: Final = Translators(MESSAGES, RESPONSES)
