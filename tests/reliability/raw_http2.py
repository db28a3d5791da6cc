"""A raw HTTP/2 gRPC client (Debian's python3-h2) for the traffic gRPC's own clients cannot make:
headers gRPC's clients never send (a grpc-timeout past year 2262), and later abusive patterns.

    status, message = unary_call(port, "/attnserve.v1.AttentionService/Attend", request_bytes,
                                 headers=[("grpc-timeout", "2200000H")])

Loopback only: every connection goes to 127.0.0.1.
"""
import socket
import struct
import sys
import time

import h2.config
import h2.connection
import h2.events
import h2.settings


def unary_call(port, path, message, headers=(), timeout_s=30.0, compressed=False):
    """Sends one gRPC message on a new connection (with the compressed flag set if
    `compressed`: the caller sends grpc-encoding); returns (grpc-status int, grpc-message str)
    from the trailers (or a trailers-only response). Raises TimeoutError past timeout_s."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    try:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                   (":authority", "localhost"),
                                   ("content-type", "application/grpc"), ("te", "trailers"),
                                   *headers])
        framed = (b"\x01" if compressed else b"\x00") + struct.pack(">I", len(message)) + message
        frame = conn.max_outbound_frame_size
        for start in range(0, len(framed), frame):
            conn.send_data(stream, framed[start:start + frame],
                           end_stream=start + frame >= len(framed))
        sock.sendall(conn.data_to_send())
        status, text = None, ""
        while status is None:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection without trailers")
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    fields = {k.decode(): v.decode() for k, v in event.headers}
                    if "grpc-status" in fields:
                        status, text = int(fields["grpc-status"]), fields.get("grpc-message", "")
                elif isinstance(event, h2.events.StreamReset):
                    raise ConnectionError(f"the server reset the stream: {event.error_code}")
            sock.sendall(conn.data_to_send())
        return status, text
    finally:
        sock.close()


def partial_messages(port, path, streams, declared_bytes, headers=(), timeout_s=30.0):
    """Opens `streams` calls on one connection, each declaring a message of `declared_bytes`
    and sending only what HTTP/2 flow control lets it before any answer, never the rest.
    Returns the grpc-status of each stream's answer ("reset" for a stream the server reset,
    None for one it never answered within timeout_s) and the bytes sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    try:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        ids, sent = [], 0
        for _ in range(streams):
            stream = conn.get_next_available_stream_id()
            conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"),
                                       (":path", path), (":authority", "localhost"),
                                       ("content-type", "application/grpc"),
                                       ("te", "trailers"), *headers])
            window = min(conn.local_flow_control_window(stream), 1 << 20)
            prefix = b"\x00" + struct.pack(">I", declared_bytes)
            body = prefix + b"\x00" * max(0, window - len(prefix))
            frame = conn.max_outbound_frame_size
            for start in range(0, window, frame):
                conn.send_data(stream, body[start:min(start + frame, window)])
            sent += window
            ids.append(stream)
        sock.sendall(conn.data_to_send())
        statuses = {stream: None for stream in ids}
        try:
            while any(status is None for status in statuses.values()):
                data = sock.recv(65536)
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, (h2.events.ResponseReceived,
                                          h2.events.TrailersReceived)):
                        fields = {k.decode(): v.decode() for k, v in event.headers}
                        if "grpc-status" in fields:
                            statuses[event.stream_id] = int(fields["grpc-status"])
                    elif (isinstance(event, h2.events.StreamReset)
                          and statuses.get(event.stream_id) is None):
                        statuses[event.stream_id] = "reset"
                sock.sendall(conn.data_to_send())
        except socket.timeout:
            pass
        return [statuses[stream] for stream in ids], sent
    finally:
        sock.close()


class Calls:
    """Many gRPC calls on one connection, driven by hand. Each call's message is sent as HTTP/2
    flow control allows. With read_answers=False the client never grants the server more window
    than HTTP/2's initial 65,535 bytes, so the server cannot send answers larger than that: it
    must hold them, as it would for a client that stopped reading.

        calls = Calls(port, read_answers=False)
        stream = calls.start("/attnserve.v1.AttentionService/Attend", request_bytes,
                             end_stream=True)
        calls.pump(seconds=5)        # sends and receives for 5 s, or until every call ended
        calls.statuses[stream]       # grpc-status, "reset", or None while open

    `source` is the loopback address the connection comes from (127.0.0.0/8). With `watch_for`
    (bytes), `mentions` holds the streams whose answer data held it within one DATA frame (an
    AttendStream's answer naming an error); the data itself is not kept.
    """

    def __init__(self, port, read_answers=True, timeout_s=30.0, source="127.0.0.1",
                 watch_for=None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s,
                                             source_address=(source, 0))
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.read_answers = read_answers
        self.timeout_s = timeout_s
        self.statuses = {}
        self.messages = {}
        self.unsent = {}  # stream -> [bytes left to send, end_stream]
        self.watch_for = watch_for
        self.mentions = set()
        self.closed = False
        self._flush()

    def start(self, path, message, headers=(), end_stream=True, compressed=False):
        """Opens a call and queues its message (None sends none), with the compressed flag set if
        `compressed` (the caller sends grpc-encoding)."""
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"),
                                        (":path", path), (":authority", "localhost"),
                                        ("content-type", "application/grpc"),
                                        ("te", "trailers"), *headers])
        flag = b"\x01" if compressed else b"\x00"
        framed = flag + struct.pack(">I", len(message)) + message if message is not None else b""
        self.statuses[stream] = None
        self.unsent[stream] = [framed, end_stream]
        self._send_what_fits()
        return stream

    def open_calls(self):
        return sum(1 for status in self.statuses.values() if status is None)

    def pump(self, seconds, until=None):
        """Sends and receives for up to `seconds`, until `until()` is true (default: no call
        left open), or until the server closes the connection."""
        until = until or (lambda: self.open_calls() == 0)
        deadline = time.monotonic() + seconds
        while not self.closed and not until():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.sock.settimeout(min(left, 0.5))
            try:
                data = self.sock.recv(1 << 20)
            except socket.timeout:
                continue
            if not data:
                self.closed = True
                break
            for event in self.conn.receive_data(data):
                self._take(event)
            self._send_what_fits()

    def close(self):
        self.sock.close()

    def _take(self, event):
        if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            fields = {k.decode(): v.decode() for k, v in event.headers}
            if "grpc-status" in fields:
                self.statuses[event.stream_id] = int(fields["grpc-status"])
                self.messages[event.stream_id] = fields.get("grpc-message", "")
                self.unsent.pop(event.stream_id, None)
        elif isinstance(event, h2.events.StreamReset):
            if self.statuses.get(event.stream_id) is None:
                self.statuses[event.stream_id] = "reset"
            self.unsent.pop(event.stream_id, None)
        elif isinstance(event, h2.events.DataReceived) and self.read_answers:
            if self.watch_for is not None and self.watch_for in event.data:
                self.mentions.add(event.stream_id)
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.closed = True

    def _send_what_fits(self):
        for stream, pending in list(self.unsent.items()):
            data, end_stream = pending
            while True:
                window = min(self.conn.local_flow_control_window(stream),
                             self.conn.max_outbound_frame_size)
                if data and window <= 0:
                    break
                chunk = data[:window]
                data = data[len(chunk):]
                last = not data
                if chunk or (last and end_stream):
                    self.conn.send_data(stream, chunk, end_stream=last and end_stream)
                if last:
                    break
            if data:
                pending[0] = data
            else:
                del self.unsent[stream]
        self._flush()

    def _flush(self):
        out = self.conn.data_to_send()
        if out:
            # The whole timeout, not what pump's last wait left of it (a millisecond or less
            # had a large message's sendall time out).
            self.sock.settimeout(self.timeout_s)
            self.sock.sendall(out)


def server_max_concurrent_streams(port, timeout_s=10.0):
    """The SETTINGS_MAX_CONCURRENT_STREAMS the server advertises (None: no limit)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    try:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        while True:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection before its SETTINGS")
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    setting = event.changed_settings.get(
                        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
                    return None if setting is None else setting.new_value
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()


def rss_bytes(pid):
    """The resident set size of process `pid` (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def exit_with(failures):
    """Prints PASS and returns if `failures` is empty; else prints them and exits 1."""
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("PASS")
