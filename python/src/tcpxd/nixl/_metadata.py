"""The agent metadata blob (get_agent_metadata / add_remote_agent).

It carries what a remote agent needs to reach this one's memory: its name, its node (id and peer
addresses), its registered regions with their raw base addresses and the daemon buffers holding
them (whose descriptors carry the access keys: treat the blob as a secret), and its mailbox (where
notifications that ride no WRITE of their own land). JSON after a magic line.

Versions: `tcpxd-nixl/2` (written) adds to each region its buffer's granule list (`g`: granule
bytes, `blk`: the list's token, `n`: its granules) and, since session 15, its fine granule list
(`fg`, `fblk`, `fn`: optional, so agents before it read the blob and skip them; without them a
list of blocks not a multiple of 4 KiB takes the batch path); `tcpxd-nixl/1` (read too) has no
lists, and its regions' transfers take the batch path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List

from ._errors import nixlInvalidParamError
from ._regions import Region

MAGIC = b"tcpxd-nixl/2\n"
#: Every version this module reads (MAGIC and older ones).
READABLE = (MAGIC, b"tcpxd-nixl/1\n")


@dataclass
class AgentMetadata:
    name: str
    node_id: str
    peer_addresses: List[str]
    mailbox: str
    regions: List[Region]
    backends: List[str]

    def encode(self) -> bytes:
        body: Dict[str, Any] = {
            "name": self.name,
            "node": self.node_id,
            "peers": self.peer_addresses,
            "mailbox": self.mailbox,
            "backends": self.backends,
            "regions": [r.to_json() for r in self.regions],
        }
        return MAGIC + json.dumps(body, separators=(",", ":")).encode()

    @staticmethod
    def decode(blob: Any) -> "AgentMetadata":
        if isinstance(blob, str):
            blob = blob.encode("latin-1")
        blob = bytes(blob)
        magic = next((m for m in READABLE if blob.startswith(m)), None)
        if magic is None:
            if blob.startswith(b"tcpxd-nixl/"):
                version = blob[len(b"tcpxd-nixl/"):].split(b"\n", 1)[0][:16].decode("ascii", "replace")
                raise nixlInvalidParamError(
                    f"metadata: tcpxd.nixl format version {version!r}, newer than this agent reads (1 and 2); "
                    "upgrade tcpxd on this side")
            raise nixlInvalidParamError(
                "metadata: not a tcpxd.nixl agent's metadata (a NIXL agent's or another library's?); "
                "both sides must use tcpxd.nixl"
            )
        try:
            d = json.loads(blob[len(magic) :])
            return AgentMetadata(
                str(d["name"]), str(d["node"]), [str(a) for a in d["peers"]], str(d["mailbox"]),
                [Region.from_json(r) for r in d["regions"]], [str(b) for b in d.get("backends", [])],
            )
        except (ValueError, KeyError, TypeError) as e:
            raise nixlInvalidParamError(f"metadata: malformed ({type(e).__name__}: {e})") from None
