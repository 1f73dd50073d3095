"""A loopback TCP proxy that cuts chosen connections after a number of bytes from the server: a dropped transfer."""

from __future__ import annotations

import contextlib
import socket
import threading


class DropProxy:
    """Forward 127.0.0.1:PORT to TARGET_PORT; the first DROPS connections that carry more than CUT_AFTER bytes
    from the server are closed right there, mid-body.

    `dropped` counts the connections cut.
    """

    def __init__(self, target_port: int, *, cut_after: int, drops: int) -> None:
        self.target_port, self.cut_after, self.drops_left = target_port, cut_after, drops
        self.dropped = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        sent = 0
        try:
            while chunk := src.recv(65536):
                if from_server and sent + len(chunk) > self.cut_after and self._take_drop():
                    dst.sendall(chunk[: max(0, self.cut_after - sent)])
                    raise ConnectionResetError("cut by the test proxy")
                dst.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _take_drop(self) -> bool:
        with self._lock:
            if self.drops_left <= 0:
                return False
            self.drops_left -= 1
            self.dropped += 1
            return True
