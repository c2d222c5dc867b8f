"""A TCP proxy on 127.0.0.1 that can cut its connections, to play storage outages, or hold
each PUT request for `put_delay_s` before passing it on, to play a slow store."""

from __future__ import annotations

import socket
import struct
import threading
import time


def free_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpProxy:
    """127.0.0.1:<port> -> target. `cut()` resets every open connection and every new one
    (an outage) until `restore()`; `refused` counts the connections turned away."""

    def __init__(self, target: str):
        host, _, port = target.rpartition(":")
        self.target = (host.split("//")[-1], int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._up = True
        self._lock = threading.Condition()
        self._open: set[socket.socket] = set()
        self.refused = 0
        self.put_delay_s = 0.0  # latency added to every PUT request (a slow store)
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    @staticmethod
    def _reset(s: socket.socket) -> None:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
            s.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                if not self._up:
                    self.refused += 1
                    self._lock.notify_all()
                    self._reset(client)
                    continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                self._reset(client)
                continue
            with self._lock:
                self._open |= {client, upstream}
            for a, b, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, request_side: bool = False) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if request_side and self.put_delay_s and data.startswith(b"PUT "):
                    time.sleep(self.put_delay_s)  # the store's latency, not a test's wait
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._open.discard(src)

    def cut(self) -> None:
        with self._lock:
            self._up = False
            for s in list(self._open):
                self._reset(s)
            self._open.clear()

    def restore(self) -> None:
        with self._lock:
            self._up = True

    def wait_refused(self, n: int, timeout: float = 30.0) -> bool:
        """Block until `n` connections were turned away during a cut (a condition, not a sleep)."""
        with self._lock:
            return self._lock.wait_for(lambda: self.refused >= n, timeout)

    def close(self) -> None:
        self._closed = True
        self.cut()
        self.listener.close()
