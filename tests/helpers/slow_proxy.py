"""A loopback TCP proxy that delays every byte from client to server: a slow etcd, healthy otherwise.

    with SlowProxy("127.0.0.1", etcd_port, delay=0.5) as proxy:
        endpoint = proxy.endpoint                      # "127.0.0.1:PORT", for the rendezvous
        proxy.delay = 1.5                              # takes effect for bytes read from now on

Each connection gets two threads per direction at most: bytes from the client are stamped when
read and forwarded ``delay`` seconds later, in order; answers come back at once. So every request
(a gRPC message, a lease renewal on a stream) reaches etcd ``delay`` seconds late.
"""

from __future__ import annotations

import queue
import socket
import threading
import time


class SlowProxy:
    def __init__(self, host: str, port: int, delay: float) -> None:
        self.target = (host, port)
        self.delay = delay
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._sockets: list[socket.socket] = [self._listener]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="slow-proxy").start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self._listener.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._sockets += [client, server]
            delayed: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._read_delayed, args=(client, delayed), daemon=True).start()
            threading.Thread(target=self._write_delayed, args=(delayed, server), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()

    def _read_delayed(self, src: socket.socket, out: queue.SimpleQueue) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            out.put((time.monotonic() + self.delay, data))
            if not data:
                return

    def _write_delayed(self, src: queue.SimpleQueue, dst: socket.socket) -> None:
        while True:
            due, data = src.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                return

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._closed.set()
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass

    def __enter__(self) -> "SlowProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
