"""How long a test waits for something that should happen at once, so a broken test
fails saying what it waited for instead of hanging (the suite's timeouts, `conftest.py`,
are the backstop, not the check).

Every wait in the tests is event-driven; these are bounds, never pauses. They are far
above what the behaviour under test takes (well under a second), so a loaded machine
does not make them fail.
"""

from __future__ import annotations

from typing import Final

#: Bound on an in-process wait: a response, a catalog change, a Node linking.
GUARD_S: Final = 5.0
#: Bound on a wait that starts an interpreter (a CLI adapter's script, a subprocess).
PROCESS_GUARD_S: Final = 10.0
