"""How long a test waits for something that should happen at once, so a broken test
fails saying what it waited for instead of hanging (the suite's timeouts, `conftest.py`,
are the backstop, not the check).

Every wait in the tests is event-driven; these are bounds, never pauses, and never the
measure of how fast something happens: a test that passes waits only as long as the
behaviour takes. They are far above what the behaviour under test takes on an idle
machine (well under a second) because a loaded one (the whole suite on every core, and
other work besides: load averages of 16-19 on 2 cores have been seen) runs each test
ten or twenty times slower. A promptness the product promises ("within a second") is
shown by what a test waits on (the event that frees a slot, not a timer), not by a
tight bound here.
"""

from __future__ import annotations

from typing import Final

#: Bound on an in-process wait: a response, a catalog change, a Node linking.
GUARD_S: Final = 30.0
#: Bound on a wait that starts an interpreter (a CLI adapter's script, a subprocess);
#: below the Trio guard of `conftest.py` (half of the 120 s test timeout).
PROCESS_GUARD_S: Final = 45.0
