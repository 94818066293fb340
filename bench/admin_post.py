"""One admin `POST` from its own process, as an operator's `iop-edge refresh` would come.

The fleet scenario measures callers' latency on the bench's event loop while it asks the
Edge for refreshes. A fleet's refresh is megabytes each way (the candidate in, the report
out); sent and read on the callers' loop, that traffic would hold the callers' requests
and be counted against the Edge. So the request comes from this child:

    python -m bench.admin_post URL BODY_FILE ANSWER_FILE TOKEN_FILE

It reads `BODY_FILE`, connects, prints `READY_LINE`, waits for a line on stdin, then
sends the body (JSON) to `URL`, writes the answer's body to `ANSWER_FILE`, and prints one
JSON line: `{"elapsed_s": ..., "status": ...}`, the time from sending to the whole
answer. The parent starts its measurement phase between the two lines.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Final

import httpx2

from iop_edge.runtime.lifecycle import admin_credential

READY_LINE: Final = "admin-post ready"
#: An apply of a fleet answers once every Node acked: tens of seconds on a busy machine.
_TIMEOUT_S: Final = 120.0


def admin_headers_in(token_file: Path) -> dict[str, str]:
    """The `Authorization` of an admin change: the credential in `token_file`."""
    return {"authorization": f"Bearer {admin_credential.read(token_file)}"}


def main(argv: list[str] | None = None) -> int:
    url, body_file, answer_file, token_file = argv if argv is not None else sys.argv[1:]
    body = Path(body_file).read_bytes()
    with httpx2.Client(timeout=_TIMEOUT_S) as client:
        client.get(url.rsplit("/", 1)[0] + "/healthz")  # connected before the go
        print(READY_LINE, flush=True)
        sys.stdin.readline()
        began = time.perf_counter()
        headers = {"content-type": "application/json", **admin_headers_in(Path(token_file))}
        response = client.post(url, content=body, headers=headers)
        elapsed = time.perf_counter() - began
    Path(answer_file).write_bytes(response.content)
    print(json.dumps({"elapsed_s": elapsed, "status": response.status_code}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
