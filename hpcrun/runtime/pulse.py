"""The pulse ring: each rank tells the next one, over UDP, twice a second, that its process runs.

A rank whose process stops (SIGSTOP, a crash that leaves it half-alive), whose node is powered off
or whose network is gone falls silent; the rank after it in the ring (rank + 1, the last rank's is
rank 0) notices within `fault.peer_timeout_s` and its watchdog ends the attempt, naming the silent
rank. So a lost node or a stopped rank is seen in seconds, by a peer, not after a hang timeout or
SLURM's down-node timeout. A rank that is slow but alive (a long save, evaluation, a data stall)
keeps pulsing from its watchdog thread, which runs whatever the training thread does.

Each rank sends one datagram to one peer and hears one: O(1) per rank whatever the job's size,
nothing on the shared filesystem, no central server, on a thread of its own (a heartbeat write
stalled on a shared filesystem must not silence a live rank). A rank that leaves the loop says so
("bye"), so its peer does not take a normal end for a silent one. Addresses are exchanged once per
attempt (a collective at the loop's start): each rank listens on every interface and says the
address its node routes to MASTER_ADDR by; a peer on the same node is reached on loopback, and one
that could only name a loopback address (its hostname mapped to 127.0.1.1, as Debian does) by its
node's name.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import typing as tp

PULSE_S = 0.5
"""How often a rank pulses: the watchdog thread's tick."""

BYE = b"bye"


def local_address(master: str) -> str:
    """The address of this node's interface towards `master` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((socket.gethostbyname(master), 9))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class Pulse:
    """This rank's side of the ring: `tick` from the watchdog thread, `silent` says whether the
    rank before it went quiet for longer than `timeout_s`, `close` says goodbye."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, master: str,
                 gather: tp.Callable[[tp.Any], list[tp.Any]], host: str = "") -> None:
        """`gather`: a collective that returns every rank's value (all_gather_object), called once."""
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.setblocking(False)
        mine = [local_address(master), self.sock.getsockname()[1], host]
        self.peers = [json.loads(p) for p in gather(json.dumps(mine))]
        self.next = self.address_of(self.peers[(rank + 1) % world_size], host)
        self.previous = (rank - 1) % world_size
        self.heard = time.monotonic()  # the ring starts together: the collective above
        self.gone = False  # the rank before said bye
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    @staticmethod
    def address_of(peer: list[tp.Any], host: str) -> tuple[str, int]:
        """Where to send to `peer` ([address, port, node]) from a rank on node `host`."""
        address, port, node = str(peer[0]), int(peer[1]), str(peer[2])
        if node == host:
            return "127.0.0.1", port
        if address.startswith("127."):
            try:
                return socket.gethostbyname(node), port
            except OSError:
                pass
        return address, port

    def start(self, on_silent: tp.Callable[[float], None]) -> None:
        """Pulse from a thread of its own; `on_silent(seconds)` when the rank before falls silent."""
        def run() -> None:
            while not self.done.wait(PULSE_S):
                self.tick()
                quiet = self.silent_s()
                if quiet is not None and not self.done.is_set():
                    on_silent(quiet)

        self.thread = threading.Thread(target=run, name="hpcrun-pulse", daemon=True)
        self.thread.start()

    @property
    def watched(self) -> str:
        """The rank this one watches, as a failure record names it."""
        host = self.peers[self.previous][2]
        return f"rank {self.previous}" + (f" on {host}" if host else "")

    def tick(self) -> None:
        """Pulse to the next rank, and hear what the rank before sent."""
        try:
            self.sock.sendto(b"%d" % self.rank, self.next)
        except OSError:  # the next rank's node gone (unreachable): its own successor will see it
            pass
        while True:
            try:
                data = self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self.heard = time.monotonic()
            if data == BYE:
                self.gone = True

    def silent_s(self) -> float | None:
        """How long the rank before has been silent, when longer than the timeout (None: not)."""
        if self.gone:
            return None
        quiet = time.monotonic() - self.heard
        return quiet if quiet > self.timeout_s else None

    def close(self) -> None:
        """Leaving the loop: tell the next rank (three times: datagrams may be lost), then close."""
        self.done.set()
        if self.thread is not None:
            self.thread.join(2 * PULSE_S)
        for _ in range(3):
            try:
                self.sock.sendto(BYE, self.next)
            except OSError:
                break
        self.sock.close()
