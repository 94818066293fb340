"""Size limits both processes and the config share (design §3, §8): how much one wire
message carries, and so how large a caller's request may be configured to be."""

from __future__ import annotations

from typing import Final

__all__ = [
    "FRAME_ENVELOPE_BYTES",
    "MAX_EVENTS_PER_MESSAGE",
    "MAX_FRAME_BYTES",
    "MAX_NODE_PROVIDERS",
    "MAX_PAYLOAD_BYTES",
]

#: The largest websocket message either side accepts from the other (an authenticated
#: peer; the Edge's hub allows an anonymous one far less). A peer that sends more is
#: disconnected, with every run on the link, so neither side ever sends more
#: (`schemas.wire.encode_bounded`).
MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
#: More tokens than any model reads or writes in one run: the bound of every token count a
#: Node reports (an upstream's number beyond it is a broken or hostile upstream's).
MAX_REPORTED_TOKENS: Final = 100_000_000
#: Room a message keeps beside its JSON payload (`run.body`, a `run_events` chunk,
#: `run_done.response`): ids, provider and target names, and msgpack framing.
FRAME_ENVELOPE_BYTES: Final = 1024 * 1024
#: The largest JSON payload one message carries: the bound config validation puts on
#: `openai.max_request_bytes`. A payload that still grows past it on the way (the Edge
#: re-encodes a request with the model's defaults) is refused where it is encoded.
MAX_PAYLOAD_BYTES: Final = MAX_FRAME_BYTES - FRAME_ENVELOPE_BYTES
#: The most run events (chunks, ends) one `run_events` message may list. A Node's writer
#: packs what its bounded outbox holds (`schemas.channel.OUTBOX_SIZE`, 256 items), so a
#: real one never comes near; the bound keeps what decoding one frame builds in proportion
#: to the frame (millions of empty entries would cost the Edge twenty times the bytes).
MAX_EVENTS_PER_MESSAGE: Final = 4096
#: The most providers one Node may have (`nodes[].providers`), and so list in a `status`
#: or `load` report.
MAX_NODE_PROVIDERS: Final = 4096
