"""An IP camera's RTSP server, for tests: a generated H.264 stream (ffmpeg's RTP muxer) played to
each client over its RTSP connection (RTP interleaved on TCP, as `StreamSource` asks), the way a
camera does it. `stop()` is the camera switched off (every connection cut, the port closed);
`start()` is the camera back on the same port, with the stream going on meanwhile; `stalled`
set is a camera that hung: its connections kept and its sessions answered, no packet sent.

Only what FFmpeg's RTSP client sends is answered: OPTIONS, DESCRIBE, SETUP, PLAY, TEARDOWN and
its keep-alives (GET_PARAMETER); its RTCP reports between them are read and dropped.
"""

from __future__ import annotations

import base64
import re
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable


ENCODERS = {  # what cameras send: H.264, H.265 (most newer ones), MJPEG (older and cheaper ones)
    "h264": ["-c:v", "libx264", "-preset", "ultrafast", "-tune", "zerolatency", "-bf", "0", "-pix_fmt", "yuv420p"],
    "hevc": ["-c:v", "libx265", "-preset", "ultrafast", "-tune", "zerolatency", "-x265-params", "log-level=none:bframes=0",
             "-pix_fmt", "yuv420p"],
    "mjpeg": ["-c:v", "mjpeg", "-huffman", "default", "-q:v", "5", "-pix_fmt", "yuvj420p"],
}


class RtspCamera:
    def __init__(self, width: int = 320, height: int = 240, fps: int = 15, codec: str = "h264",
                 tcp: bool = True, password: str | None = None):
        self._rtp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # ffmpeg sends its RTP here
        self._rtp.bind(("127.0.0.1", 0))
        self._rtp.settimeout(0.2)
        self._out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # RTP to the clients that asked for UDP
        self._out.bind(("127.0.0.1", 0))
        self.tcp = tcp  # False: a camera that plays over UDP only (461 Unsupported Transport for TCP)
        # Given: DESCRIBE needs Basic authorization as user "admin" with it (401 Unauthorized otherwise)
        self._auth = None if password is None else "Basic " + base64.b64encode(f"admin:{password}".encode()).decode()
        self._dir = tempfile.TemporaryDirectory()
        sdp = Path(self._dir.name) / "cam.sdp"
        self._ffmpeg = subprocess.Popen(
            ["ffmpeg", "-nostdin", "-loglevel", "error", "-re", "-f", "lavfi",
             "-i", f"testsrc=size={width}x{height}:rate={fps}", *ENCODERS[codec], "-g", str(fps), "-f", "rtp",
             "-sdp_file", str(sdp), f"rtp://127.0.0.1:{self._rtp.getsockname()[1]}?pkt_size=1200"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while "m=video" not in (sdp.read_text() if sdp.exists() else ""):
            if time.monotonic() > deadline or self._ffmpeg.poll() is not None:
                self.close()
                raise RuntimeError("ffmpeg wrote no SDP for the test camera")
            time.sleep(0.05)
        self._sdp = sdp.read_text()
        self._lock = threading.Lock()
        self._playing: dict[socket.socket, Callable[[bytes], None]] = {}  # client -> how its RTP is sent
        self._clients: list[socket.socket] = []
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        self.port = 0
        self.stalled = False  # connections kept, nothing sent (a hung camera)
        self.sessions = 0  # PLAYs answered: one per (re)connection of a client
        self.asked: list[str] = []  # the Transport header of each SETUP
        threading.Thread(target=self._relay, daemon=True).start()
        self.start()

    @property
    def url(self) -> str:
        return f"rtsp://127.0.0.1:{self.port}/cam"

    def start(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen()
        self.port, self._listener = s.getsockname()[1], s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            clients, self._clients = self._clients, []
            self._playing.clear()
        for s in ([listener] if listener else []) + clients:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._closed.set()
        self.stop()
        self._ffmpeg.kill()
        self._ffmpeg.wait(10)
        self._rtp.close()
        self._out.close()
        self._dir.cleanup()

    def __enter__(self) -> "RtspCamera":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                if self._listener is not listener:
                    conn.close()
                    return
                self._clients.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _relay(self) -> None:
        while not self._closed.is_set():
            try:
                packet = self._rtp.recv(65536)
            except (socket.timeout, OSError):
                continue
            with self._lock:
                playing = [] if self.stalled else list(self._playing.items())
            for conn, send in playing:
                try:
                    send(packet)
                except OSError:
                    with self._lock:
                        self._playing.pop(conn, None)

    def _serve(self, conn: socket.socket) -> None:
        send_lock, buf = threading.Lock(), b""
        sends: list[Callable[[bytes], None]] = []  # how this client's RTP goes, once SETUP said
        try:
            while True:
                while buf[:1] == b"$":  # RTCP from the client, interleaved: dropped
                    if len(buf) < 4:
                        break
                    size = 4 + struct.unpack(">H", buf[2:4])[0]
                    if len(buf) < size:
                        break
                    buf = buf[size:]
                if b"\r\n\r\n" not in buf or buf[:1] == b"$":
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                    continue
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode().split("\r\n")
                method, url = lines[0].split()[:2]
                headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
                body_len = int(headers.get("content-length", 0))
                while len(buf) < body_len:
                    buf += conn.recv(65536)
                buf = buf[body_len:]
                extra, body, status = {}, b"", "200 OK"
                if method == "OPTIONS":
                    extra["Public"] = "OPTIONS, DESCRIBE, SETUP, PLAY, TEARDOWN, GET_PARAMETER"
                elif method == "DESCRIBE" and self._auth and headers.get("authorization") != self._auth:
                    status = "401 Unauthorized"
                    extra["WWW-Authenticate"] = 'Basic realm="camera"'
                elif method == "DESCRIBE":
                    sdp = "".join(re.sub(r"^m=video \d+", "m=video 0", l) + "\r\n"  # the port is RTP's, not ours
                                  for l in self._sdp.splitlines() if l) + "a=control:track1\r\n"
                    body = sdp.encode()
                    extra.update({"Content-Base": f"{self.url}/", "Content-Type": "application/sdp"})
                elif method == "SETUP":
                    asked = headers.get("transport", "")
                    self.asked.append(asked)
                    client_port = re.search(r"client_port=(\d+)", asked)
                    if "TCP" in asked and self.tcp:
                        extra["Transport"] = "RTP/AVP/TCP;unicast;interleaved=0-1"

                        def interleaved(packet: bytes, conn=conn) -> None:
                            with send_lock:
                                conn.sendall(b"$\x00" + struct.pack(">H", len(packet)) + packet)
                        sends.append(interleaved)
                    elif client_port and "TCP" not in asked:
                        port, out = self._out.getsockname()[1], self._out
                        extra["Transport"] = f"RTP/AVP;unicast;client_port={client_port[1]}-{int(client_port[1]) + 1};" \
                                             f"server_port={port}-{port + 1}"

                        def datagram(packet: bytes, to=(conn.getpeername()[0], int(client_port[1]))) -> None:
                            out.sendto(packet, to)
                        sends.append(datagram)
                    else:
                        status = "461 Unsupported Transport"
                    extra["Session"] = "4242;timeout=60"
                elif method == "PLAY":
                    extra.update({"Session": "4242", "Range": "npt=0.000-"})
                reply = f"RTSP/1.0 {status}\r\nCSeq: {headers.get('cseq', '0')}\r\n"
                reply += "".join(f"{k}: {v}\r\n" for k, v in extra.items())
                reply += f"Content-Length: {len(body)}\r\n\r\n"
                with send_lock:
                    conn.sendall(reply.encode() + body)
                if method == "PLAY":
                    with self._lock:
                        if conn in self._clients and sends:
                            self._playing[conn] = sends[-1]
                            self.sessions += 1
                elif method == "TEARDOWN":
                    return
        except (OSError, ValueError, UnicodeDecodeError):
            return
        finally:
            with self._lock:
                self._playing.pop(conn, None)
                if conn in self._clients:
                    self._clients.remove(conn)
            conn.close()
