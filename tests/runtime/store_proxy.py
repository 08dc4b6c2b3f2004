"""A TCP relay in front of an object store (moto's server), to take the store away under a running client.

`down()` closes every relayed connection and refuses new ones (what an unreachable endpoint does: the client gets
a reset or a refused connection), `up()` serves again; `cut_after(n)` goes down by itself once `n` more bytes went
upstream (the store lost in the middle of an upload).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator


class StoreProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._serving = True
        self._budget: int | None = None
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def down(self) -> None:
        with self._lock:
            self._serving = False
            sockets, self._open = self._open, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def up(self) -> None:
        with self._lock:
            self._serving, self._budget = True, None

    def cut_after(self, upstream_bytes: int) -> None:
        with self._lock:
            self._budget = upstream_bytes

    def close(self) -> None:
        self._closed = True
        self.down()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                serving = self._serving
            if not serving:
                with contextlib.suppress(OSError):  # a reset, as from a host with nothing listening
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, outbound: bool) -> None:
        try:
            while data := source.recv(65536):
                if outbound and not self._spend(len(data)):
                    self.down()
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _spend(self, size: int) -> bool:
        with self._lock:
            if not self._serving:
                return False
            if self._budget is None:
                return True
            self._budget -= size
            return self._budget >= 0


@contextlib.contextmanager
def served_store(prepare: Callable[[str], object]) -> Iterator[tuple[str, StoreProxy]]:
    """A moto S3 server on a free port, `prepare(endpoint)` run once it listens (make its buckets), and a relay in
    front of it: (the server's own endpoint, the relay). Callers importorskip `moto.server` first."""
    from moto import server as moto_server

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    prepare(endpoint)
    proxy = StoreProxy(host, port)
    try:
        yield endpoint, proxy
    finally:
        proxy.close()
        server.stop()
