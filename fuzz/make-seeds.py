#!/usr/bin/env python3
"""Writes the seed corpus of each fuzz target into fuzz/seeds/<target>/ from real traffic where
there is some on this machine (curl's, OpenSSL's and Python's ClientHellos, curl's request
heads, glibc-shaped DNS queries) and from the shapes our own tests use (provider bodies, agent
frames, guest frames). Run it again to refresh; libFuzzer grows its own corpus from these."""
import json
import os
import socket
import ssl
import struct
import subprocess
import threading
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "seeds", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def capture(client):
    """The first bytes a client sends to a listener on loopback (its ClientHello or request)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    got = {}

    def accept():
        c, _ = srv.accept()
        c.settimeout(3)
        buf = b""
        try:
            while len(buf) < 65536:
                b = c.recv(65536)
                if not b:
                    break
                buf += b
                if buf.startswith(b"\x16") and len(buf) >= 5 and len(buf) >= 5 + struct.unpack(">H", buf[3:5])[0]:
                    break
                if b"\r\n\r\n" in buf and not buf.startswith(b"\x16"):
                    break
        except socket.timeout:
            pass
        got["bytes"] = buf
        c.close()

    t = threading.Thread(target=accept)
    t.start()
    try:
        client(port)
    except Exception:
        pass
    t.join(10)
    srv.close()
    return got.get("bytes", b"")


def run(*args):
    subprocess.run(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)


def py_tls(port):
    ctx = ssl.create_default_context()
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        ctx.wrap_socket(s, server_hostname="api.anthropic.com")


# tls_hello: a seed byte 0 (whole) then the hello.
hellos = {
    "curl": capture(lambda p: run("curl", "-sk", "--max-time", "3", "--connect-to", f"api.openai.com:443:127.0.0.1:{p}", "https://api.openai.com/")),
    "curl-http2": capture(lambda p: run("curl", "-sk", "--http2", "--max-time", "3", "--connect-to", f"example.org:443:127.0.0.1:{p}", "https://example.org/")),
    "openssl": capture(lambda p: run("openssl", "s_client", "-connect", f"127.0.0.1:{p}", "-servername", "registry.npmjs.org", "-alpn", "h2,http/1.1")),
    "python": capture(py_tls),
}
for name, h in hellos.items():
    if h:
        put("tls_hello", name, b"\x00" + h)
        put("tls_hello", name + "-split", b"\x07" + h)

# http_head: curl's own heads, and the absolute form of a proxy request.
for name, args in {
    "get": ["--max-time", "2"],
    "post": ["--max-time", "2", "-d", '{"a":1}', "-H", "content-type: application/json"],
}.items():
    h = capture(lambda p, a=args: run("curl", "-s", *a, f"http://127.0.0.1:{p}/v1/x?y=1"))
    if h:
        put("http_head", name, h)
put("http_head", "absolute", b"GET http://allowed.test:8080/a HTTP/1.1\r\nHost: allowed.test:8080\r\nUser-Agent: t\r\n\r\n")
put("http_head", "h2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")


# dns_query: as glibc asks (A and AAAA), and a response (never answered).
def query(qid, name, qtype, flags=0x0100):
    q = struct.pack(">6H", qid, flags, 1, 0, 0, 0)
    for l in name.split("."):
        q += bytes([len(l)]) + l.encode()
    return q + b"\x00" + struct.pack(">HH", qtype, 1)


put("dns_query", "a", query(0x1234, "api.anthropic.com", 1))
put("dns_query", "aaaa", query(0x1235, "registry.npmjs.org", 28))
put("dns_query", "response", query(0x1236, "example.com", 1, flags=0x8180))
put("dns_query", "pointer", struct.pack(">6H", 7, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c" + struct.pack(">HH", 1, 1))

# usage_meter: provider bodies as the egress tests' fake provider sends them.
anthropic_json = {"id": "msg_01", "type": "message", "model": "claude-sonnet-4", "usage": {"input_tokens": 12, "output_tokens": 34, "cache_read_input_tokens": 5, "cache_creation_input_tokens": 6}}
openai_json = {"id": "chatcmpl-1", "model": "gpt-4o", "usage": {"prompt_tokens": 9, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2}}}
router_json = {"id": "gen-1", "model": "x/y", "usage": {"prompt_tokens": 3, "completion_tokens": 4, "cost": 0.0012}}
for name, doc in {"anthropic": anthropic_json, "openai": openai_json, "openrouter": router_json}.items():
    put("usage_meter", "json-" + name, b"\x00\x00" + json.dumps(doc).encode())
sse_anthropic = (
    'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_01","model":"claude","usage":{"input_tokens":10,"output_tokens":1}}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"hi"}}\n\n'
    'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":25}}\n\n'
)
sse_openai = (
    'data: {"id":"chatcmpl-2","model":"gpt-4o","choices":[{"delta":{"content":"hi"}}]}\n\n'
    'data: {"id":"chatcmpl-2","model":"gpt-4o","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":6}}\n\n'
    "data: [DONE]\n\n"
)
sse_responses = (
    'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1","model":"gpt-5","usage":{"input_tokens":8,"output_tokens":9}}}\n\n'
)
for name, body in {"anthropic": sse_anthropic, "openai": sse_openai, "responses": sse_responses}.items():
    put("usage_meter", "sse-" + name, b"\x01\x05" + body.encode())

# meter_request: the first byte picks the API path (0 messages, 1 chat, 2 responses, 3 router, 4 completions).
put("meter_request", "chat-stream", b"\x01" + json.dumps({"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode())
put("meter_request", "chat-stream-options", b"\x01" + json.dumps({"model": "gpt-4o", "stream": True, "stream_options": {"include_usage": False}, "messages": []}).encode())
put("meter_request", "responses-background", b"\x02" + json.dumps({"model": "gpt-5", "background": True, "input": "hi"}).encode())
put("meter_request", "messages", b"\x00" + json.dumps({"model": "claude", "max_tokens": 10, "messages": []}).encode())

# leak_scanner: which secret, where (u16 LE), the split seed, then a body.
put("leak_scanner", "json", b"\x00\x10\x00\x05" + b'{"prompt":"the key is here","model":"x"}')
put("leak_scanner", "form", b"\x01\x00\x00\x00" + b"a=1&b=2&c=3")


# protocol_decoder: frames as the agent channel carries them (see protocol/src/frame.rs).
def frame(kind, stream, payload):
    head = b"SBX1" + bytes([kind, 0, 0, 0]) + struct.pack("<II", stream, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head[:16])) & 0xFFFFFFFF
    return head + struct.pack("<I", crc) + payload


hello = frame(1, 0, json.dumps({"version": 1}).encode())
put("protocol_decoder", "hello", b"\x00" + hello)
put("protocol_decoder", "stream", b"\x09" + hello + frame(3, 1, b"x" * 300) + frame(4, 1, b""))
put("protocol_decoder", "garbage", b"\x03" + b"noise" + hello)

# egress_gate: a DNS query for an allowed name, then a TCP SYN to the first pool address on 443.
put("egress_gate", "dns-then-syn", bytes([1, 0x12, 0x34, 0, 0, 2, 0x00, 0x00, 0x01, 0xbb, 0x02, 0]))
put("egress_gate", "denied-name", bytes([1, 0, 1, 0, 3]))
put("egress_gate", "udp-elsewhere", bytes([3, 17, 8, 8, 8, 8, 12]) + b"\x00\x35\x00\x35\x00\x0c\x00\x00abcd")
arp = GATEWAY = bytes([0xff] * 6) + bytes([2, 0, 0, 0, 0, 7]) + b"\x08\x06" + bytes([0, 1, 8, 0, 6, 4, 0, 1, 2, 0, 0, 0, 0, 7, 10, 233, 0, 2, 0, 0, 0, 0, 0, 0, 10, 233, 0, 1])
put("egress_gate", "arp", bytes([0]) + struct.pack(">H", len(arp)) + arp)

# virtio_devices: a guest driver's sessions in the target's op encoding (see its drive()).
class Driver:
    """Encodes one session: byte 0 the device (0 block, 1 net, 2 vsock), then ops."""

    def __init__(self, device, *prefix):
        self.b = bytes([device, *prefix])

    def start(self, queues, size=256):
        # op 3: the usual start; features offered: all (the device keeps what it knows).
        self.b += bytes([3]) + struct.pack("<I", 0xFFFFFFFF) + bytes([size.bit_length() - 1] * queues)

    def mem(self, at, data):
        for i in range(0, len(data), 255):  # op 2 writes at most 255 bytes
            part = data[i:i + 255]
            self.b += bytes([2]) + struct.pack("<IB", at + i, len(part)) + part

    def chain(self, q, descs):
        # op 4: up to four (address, length, device-writable) descriptors, published.
        self.b += bytes([4, q, len(descs) - 1])
        for addr, length, w in descs:
            self.b += struct.pack("<IHB", addr, length, int(w))

    def kick(self, q):
        self.b += bytes([5, q])

    def host(self, data):
        self.b += bytes([7]) + data


for name, kind, sector in [("block-read", 0, 3), ("block-write", 1, 5), ("block-flush", 4, 0),
                           ("block-get-id", 8, 0)]:
    d = Driver(0, 0)
    d.start(1)
    d.mem(0x4000, struct.pack("<IIQ", kind, 0, sector) + bytes(range(255)) * 3)
    data = 20 if kind == 8 else 512
    d.chain(0, [(0x4000, 16, False), (0x5000, data, kind != 1), (0x6000, 1, True)])
    d.kick(0)
    put("virtio_devices", name, d.b)
d = Driver(0, 1)  # read-only: a write is refused
d.start(1)
d.mem(0x4000, struct.pack("<IIQ", 1, 0, 0))
d.chain(0, [(0x4000, 16, False), (0x5000, 512, False), (0x6000, 1, True)])
d.kick(0)
put("virtio_devices", "block-write-read-only", d.b)

# net: queue 0 receives, queue 1 transmits; a 12-byte virtio-net header leads each buffer.
d = Driver(1)
d.start(2)
d.chain(0, [(0x4000, 2048, True)])
d.chain(0, [(0x5000, 12, True), (0x5100, 1514, True)])
arp = bytes([0xff] * 6) + bytes([2, 0, 0, 0, 0, 1]) + b"\x08\x06" + bytes(28)
d.host(struct.pack("<H", len(arp)) + arp)
d.kick(0)
d.mem(0x8000, bytes(12) + arp)
d.chain(1, [(0x8000, 12 + len(arp), False)])
d.chain(1, [(0x8000, 12, False), (0x800c, len(arp), False)])
d.kick(1)
put("virtio_devices", "net-rx-tx", d.b)

# vsock: queue 0 receives, 1 transmits, 2 events. The host connects to guest port 1024, the
# guest answers RESPONSE and sends bytes (RW), asks for credit, and shuts down.
def vsock_header(op, length=0, flags=0):
    return struct.pack("<QQIIIHHIII", 3, 2, 1024, 1024, length, 1, op, flags, 65536, 0)


d = Driver(2)
d.start(3)
for i in range(4):
    d.chain(0, [(0x4000 + 0x1000 * i, 4096, True)])
d.chain(2, [(0x9000, 8, True)])
d.host(struct.pack("<H", 1024))
d.kick(0)
d.mem(0xa000, vsock_header(2))
d.chain(1, [(0xa000, 44, False)])
d.mem(0xa100, vsock_header(5, 5) + b"hello")
d.chain(1, [(0xa100, 44, False), (0xa100 + 44, 5, False)])
d.mem(0xa200, vsock_header(7))
d.chain(1, [(0xa200, 44, False)])
d.mem(0xa300, vsock_header(4, 0, 3))
d.chain(1, [(0xa300, 44, False)])
d.kick(1)
d.kick(0)
put("virtio_devices", "vsock-connect", d.b)

# tcp_stack: a guest speaking raw TCP in the target's op encoding (see its fuzz_target!).
def tcp_session(payload_kind, closing):
    b = bytes([0, 0, 4, 5])  # DNS for the allowed name, wait 5 ms

    def seg(k, flags, kind=0, opts=0, seq_off=0, ack_off=0):
        return bytes([1, k, flags]) + struct.pack(">hhH", seq_off, ack_off, 0xFFFF) + bytes([opts, kind, 0])

    b += seg(0, 0x02, opts=0x77) + bytes([4, 5])  # SYN with MSS, window scale 7, SACK; wait
    b += seg(0, 0x10)  # ACK of the SYN-ACK
    b += seg(0, 0x18, payload_kind) + bytes([4, 15])  # the first bytes; wait
    b += seg(0, 0x10) + bytes([4, 10])
    b += closing
    return b


put("tcp_stack", "http", tcp_session(1, bytes([1, 0, 0x11]) + struct.pack(">hhH", 0, 0, 0xFFFF) + bytes([0, 0, 0, 4, 10])))
put("tcp_stack", "tls-splice", tcp_session(2, bytes([1, 0, 0x04]) + struct.pack(">hhH", 0, 0, 0) + bytes([0, 0, 0])))
put("tcp_stack", "syn-before-dns", bytes([1, 1, 0x02]) + struct.pack(">hhH", 0, 0, 0xFFFF) + bytes([0, 0, 0, 4, 5]))
put("tcp_stack", "out-of-window", tcp_session(3, bytes([2, 0, 0x18]) + struct.pack(">hhH", -3000, 4000, 1) + bytes([8, 3]) + struct.pack(">H", 40) + b"x" * 40 + bytes([0, 4, 15])))

# protocol_client: the agent's side of a session in the target's op encoding (see its session()),
# with the host's stdin and upload writes (op 4, then a count of 1 KiB or, with 0x80, 64 KiB; 0 ends).
def agent(k, stream, n=0, extra=b""):
    return bytes([0, k, stream, n]) + extra


def data(k, stream, length, seed=0x41):
    return agent(k, stream, 0, struct.pack(">HB", length, seed))


window = lambda stream, n: agent(7, stream, 0, struct.pack("<I", n))
session = (agent(0, 0, 5) + bytes([4, 3, 4, 0x80 | 20]) + window(1, 1 << 20) + data(1, 1, 1000) + data(2, 1, 10) + bytes([4, 10])
           + agent(3, 1, 128) + data(4, 2, 5000) + data(4, 2, 0) + window(3, 1 << 21)
           + bytes([4, 50, 4, 0, 4, 0x80]) + agent(5, 3, 3) + agent(0, 5, 1) + data(4, 4, 3000))
put("protocol_client", "session", session)
put("protocol_client", "refusals", agent(0, 0) + agent(6, 1) + agent(6, 2) + agent(6, 3) + agent(6, 4))
put("protocol_client", "flood", agent(0, 0) + data(4, 4, 16000) + bytes([2, 80]) + agent(3, 1) + bytes([2, 255]))
put("protocol_client", "bad-frames", agent(0, 0) + bytes([0, 8, 1, 0, 0x02, 3]) + b"abc" + bytes([3, 8]) + b"SBX1\x85\x00\x00\x00")

# api_requests: requests in the target's encoding (method, id, route with 0x80 for a query,
# query text, auth/host/content-type byte, then the body); the bodies are the documented ones.
def api(method, route, body=b"", query=None, auth=0):
    b = bytes([method, 0, route | (0x80 if query is not None else 0)])
    if query is not None:
        b += bytes([len(query)]) + query
    return b + bytes([auth]) + body


create = {"run_id": "run-1", "time_limit_ms": 600000, "review": False, "memory_mib": 512, "vcpus": 1,
          "image": "stock", "env": {"A": "1"}, "egress": {"allow": ["api.example.com", "*.example.org:443"],
          "meter": ["api.anthropic.com"], "secrets": [{"env": "KEY", "value": "sk-1", "hosts": ["api.anthropic.com"]}]}}
put("api_requests", "create", api(1, 2, json.dumps(create).encode()))
put("api_requests", "list", api(0, 3))
put("api_requests", "exec", api(1, 8, json.dumps({"argv": ["echo", "hi"], "timeout_ms": 1000, "env": {"X": "y"}, "cwd": "/tmp"}).encode()))
put("api_requests", "exec-command", api(1, 8, json.dumps({"command": "echo hi | wc -c", "stdin": True}).encode()))
put("api_requests", "file-get", api(0, 7, query=b"path=/etc/hosts"))
put("api_requests", "file-put", api(2, 7, b"hello", query=b"path=/tmp/x&mode=0644", auth=0x40))
put("api_requests", "archive-put", api(2, 6, b"\x1f\x8b" + bytes(30), query=b"path=/work", auth=0x40))
put("api_requests", "keepalive", api(1, 5))
put("api_requests", "delete", api(3, 4))
put("api_requests", "no-token", api(0, 3, auth=3))
put("api_requests", "foreign-host", api(0, 3, auth=8))
put("api_requests", "id-not-utf8", bytes([0, 2, 3]) + b"%ff" + bytes([4, 0]))
print("seeds written to", os.path.join(HERE, "seeds"))
