"""Hold every packet of an NFQUEUE queue for a fixed time, then let it through.

`python -m chaos.delay QUEUE SECONDS`, run in the router namespace that sends packets to
the queue (`iptables ... -j NFQUEUE --queue-num QUEUE`): a link with latency, for a
kernel without `netem`. It speaks nfnetlink_queue directly (bind, copy metadata only,
accept each packet id when due); prints "bound" once the queue has its reader. Packets
keep their order, since each waits the same time.
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
QUEUE_LENGTH = 20_000


def _attribute(kind: int, payload: bytes) -> bytes:
    header = struct.pack("=HH", 4 + len(payload), kind)
    return header + payload + b"\0" * (-len(payload) % 4)


def _message(kind: int, queue: int, attributes: bytes, flags: int) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attributes
    header = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, 0, 0)
    return header + body


def _config(sock: socket.socket, queue: int, attributes: bytes) -> None:
    sock.send(_message(NFQNL_MSG_CONFIG, queue, attributes, NLM_F_REQUEST | NLM_F_ACK))
    reply = sock.recv(65536)
    _, kind, _, _, _ = struct.unpack_from("=IHHII", reply)
    (code,) = struct.unpack_from("=i", reply, 16)
    if kind == NLMSG_ERROR and code != 0:
        raise OSError(-code, f"nfnetlink_queue config refused: {code}")


def packet_ids(data: bytes) -> list[int]:
    """The packet ids of the queue messages in one netlink read."""
    ids = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind, _, _, _ = struct.unpack_from("=IHHII", data, offset)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            at = offset + 20
            while at + 4 <= offset + length:
                size, attribute = struct.unpack_from("=HH", data, at)
                if size < 4:
                    break
                if attribute & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, at + 4)[0])
                at += (size + 3) & ~3
        offset += (length + 3) & ~3
    return ids


def main(argv: list[str]) -> int:
    queue, seconds = int(argv[0]), float(argv[1])
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    _config(sock, queue, _attribute(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0)))
    _config(sock, queue, _attribute(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)))
    _config(sock, queue, _attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_LENGTH)))
    print("bound", flush=True)
    held: collections.deque[tuple[float, int]] = collections.deque()
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([sock], [], [], wait)
        if readable:
            due = time.monotonic() + seconds
            held.extend((due, packet) for packet in packet_ids(sock.recv(1 << 20)))
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, packet = held.popleft()
            verdict = _attribute(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet))
            sock.send(_message(NFQNL_MSG_VERDICT, queue, verdict, NLM_F_REQUEST))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
