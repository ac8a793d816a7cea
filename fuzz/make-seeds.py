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

# agent_archive: tar streams in the target's encoding (see its build()): byte 0 the mode (bits 0-1:
# 3 = raw bytes, else built entries; 4 gzip; 8 gzip cut short; 0x10 no end blocks; 0x20 target
# already there), then entries: type byte (low 4 bits index TYPES, bits 4-5 the header format,
# 0x40 bad checksum, 0x80 a size lie), path, link name (links only), mode, mtime, data.
ARCHIVE_TYPES = {"0": 0, "5": 2, "2": 3, "1": 5, "3": 7, "4": 8, "6": 9, "7": 10, "L": 11, "K": 12, "x": 13, "S": 14}
ARCHIVE_PARTS = ["a", "b", "c", ".", "..", "", "out", "bait", "a", "..", "baitdir", "f"]


def archive_name(name):
    """A path: components of ARCHIVE_PARTS when it is made of them, else raw bytes."""
    if isinstance(name, list):
        return bytes([len(name)] + [ARCHIVE_PARTS.index(p) for p in name])
    raw = name.encode()
    assert len(raw) < 64
    return bytes([0xC0 | len(raw)]) + raw


def archive_entry(kind, name, link=None, mode=0o644, data=b"", lie=None):
    b = bytes([ARCHIVE_TYPES[kind] | (0x80 if lie is not None else 0)]) + archive_name(name)
    if kind in "12":
        b += archive_name(link)
    b += struct.pack("<HB", mode, 0x40)
    if kind in "LK":
        b += archive_name(data)
    elif kind == "x":
        b += archive_name(data) + bytes([0])
    else:
        b += bytes([len(data)]) + data
    if lie is not None:
        b += bytes([lie])
    return b


# The shapes of the agent's own archive tests: a tree with a directory, a file, a symlink and a
# hard link (plain and gzip); inner symlinks; the refused kinds.
tree = (archive_entry("5", "d/", mode=0o755) + archive_entry("0", "d/file", data=b"hello")
        + archive_entry("2", "d/link", link="file") + archive_entry("1", "d/hard", link="d/file")
        + archive_entry("0", "d/exec", mode=0o4755, data=b"#!/bin/sh\n"))
put("agent_archive", "tree", b"\x00" + tree)
put("agent_archive", "tree-gz", b"\x04" + tree)
put("agent_archive", "tree-gz-cut", b"\x0c" + tree)
put("agent_archive", "inner-symlinks", b"\x20" + archive_entry("0", "d/file", data=b"hello")
    + archive_entry("2", "d/link", link="file") + archive_entry("2", "up", link="d/../d/file"))
put("agent_archive", "dictionary", b"\x00" + archive_entry("5", ["a"]) + archive_entry("2", ["a", "b"], link=["."])
    + archive_entry("0", ["a", "b", "f"], data=b"x") + archive_entry("1", ["c"], link=["a", "f"]))
for name, entry in {"parent": archive_entry("0", "../evil", data=b"x"), "absolute": archive_entry("0", "/etc/evil"),
                    "symlink-out": archive_entry("2", "sub/link", link="../../etc"), "device": archive_entry("3", "dev"),
                    "hard-link-out": archive_entry("1", "h", link="../bait"), "fifo": archive_entry("6", "fifo")}.items():
    put("agent_archive", "refused-" + name, b"\x00" + archive_entry("0", "ok", data=b"ok") + entry)
put("agent_archive", "long-names", b"\x00" + archive_entry("L", "x", data="d/" + "n" * 60) + archive_entry("0", "short", data=b"long")
    + archive_entry("x", "y", data="p/" + "q" * 50) + archive_entry("2", "z", link="target"))
put("agent_archive", "size-lies", b"\x10" + archive_entry("0", "big", data=b"abc", lie=2) + archive_entry("5", "dir", data=b"abc", lie=0))

# The compact encoding (mode 0x40): two bytes an entry, kind (file, dir, symlink, hard link) and
# an index into the target's PATHS, then an index into LINKS and a data length.
def compact(kind, path, link=0, length=0):
    return bytes([kind | path << 2, link | length << 4])


put("agent_archive", "compact", b"\x40" + compact(1, 0) + compact(0, 3, 0, 5) + compact(2, 1, 2) + compact(3, 2, 5))


def real_tar(fmt, gz=False):
    """A tar written by Python's tarfile (what a client might upload), as raw input (mode 3)."""
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        def add(name, kind, data=b"", link="", mode=0o644):
            i = tarfile.TarInfo(name)
            i.type, i.size, i.linkname, i.mode, i.mtime = kind, len(data), link, mode, 1700000000
            t.addfile(i, io.BytesIO(data) if data else None)
        add("./", tarfile.DIRTYPE, mode=0o755)
        add("./src/", tarfile.DIRTYPE, mode=0o755)
        add("./src/main.rs", tarfile.REGTYPE, b"fn main() {}\n")
        add("./src/" + "long" * 30 + ".txt", tarfile.REGTYPE, b"long name\n")
        add("./latest", tarfile.SYMTYPE, link="src/main.rs")
        add("./again", tarfile.LNKTYPE, link="./src/main.rs")
    # tarfile pads to a 10 KiB record: keep the two end blocks only.
    data = buf.getvalue().rstrip(b"\0")
    data += bytes(-len(data) % 512 + 1024)
    if gz:
        import gzip
        data = gzip.compress(data, mtime=0)  # no timestamp: the seed stays the same
    return data


put("agent_archive", "python-gnu", b"\x03" + real_tar(1))  # tarfile.GNU_FORMAT
put("agent_archive", "python-pax-gz", b"\x03" + real_tar(2, gz=True))  # tarfile.PAX_FORMAT
# agent_server: a host's sessions in the target's op encoding (see its session()): byte 0 seeds
# the write chunks (0: each frame whole), then ops. Streams are picked by a byte (0-6 that id);
# words by a length and letters (0 = "a" ... 35 = "9"); programs by index into its PROGRAMS
# (0 cat, 1 echo WORD, 2 exit 3, 3 sleep, 4 100 KB out, 5 1.2 MB out, 6 stderr), 0x10 stdin,
# 0x20 a timeout.
def sw(w):
    return bytes([len(w)] + ["abcdefghijklmnopqrstuvwxyz0123456789".index(c) for c in w])


def s_exec(stream, how, w="", timeout=None):
    return bytes([1, stream, how]) + sw(w) + (bytes([timeout]) if timeout is not None else b"")


def s_data(op, stream, data):
    return bytes([op, stream, len(data)]) + data


def s_window(stream, sel, value=0):
    return bytes([5, stream, sel]) + (struct.pack("<I", value) if sel == 3 else b"")


WAIT = bytes([15, 10])
put("agent_server", "ping", b"\x00" + bytes([0, 0, 0, 1]))
put("agent_server", "exec-cat-stdin", b"\x00" + s_exec(1, 0x10) + s_data(2, 1, b"hello\n") + s_data(2, 1, b"") + WAIT + s_window(1, 2))
put("agent_server", "exec-cat-split", b"\x05" + s_exec(1, 0x10) + s_data(2, 1, b"hello\n") + WAIT + bytes([4, 1, 25]) + s_data(2, 1, b""))
put("agent_server", "exec-echo", b"\x00" + s_exec(2, 1, "hi") + WAIT)
put("agent_server", "exec-100k", b"\x00" + s_exec(1, 4) + WAIT + WAIT + WAIT)
put("agent_server", "exec-window", b"\x00" + s_exec(1, 5) + WAIT + s_window(1, 3, 100000) + WAIT + s_window(1, 1) + WAIT)
put("agent_server", "exec-timeout", b"\x00" + s_exec(3, 0x23, timeout=10) + WAIT + WAIT)
put("agent_server", "exec-signal-cancel", b"\x00" + s_exec(1, 0x10) + s_exec(2, 0x10) + WAIT + bytes([4, 1, 19]) + bytes([4, 2, 200]) + bytes([6, 2]) + WAIT)
put("agent_server", "exec-stderr-shell", b"\x00" + s_exec(1, 6) + s_exec(2, 0x80) + s_exec(3, 0xC0, "ab") + s_exec(0, 1) + WAIT)
put("agent_server", "file-put-get", b"\x00" + bytes([9, 1]) + sw("f") + struct.pack("<H", 0o645) + s_data(3, 1, b"hello") + s_data(3, 1, b"") + WAIT
    + bytes([10, 2]) + sw("f") + WAIT + bytes([10, 3]) + sw(""))
tar_entries = bytes([2, 1]) + sw("d") + bytes([0xED]) + bytes([0]) + sw("x") + bytes([0xA4, 5]) + b"hello"
put("agent_server", "archive-put-get", b"\x00" + bytes([11, 1]) + sw("t") + bytes([15]) + tar_entries + WAIT + bytes([12, 2]) + sw("t") + WAIT)
put("agent_server", "archive-put-split", b"\x09" + bytes([11, 1]) + sw("t") + bytes([0x82]) + tar_entries + bytes([6, 1]) + WAIT)
put("agent_server", "garbage", b"\x07" + bytes([13, 10]) + b"noise SBX0" + bytes([14, 2, 1, 0, 5]) + b"abcde" + bytes([0, 1])
    + bytes([8, 0x81, 1, 3]) + b"{}x" + bytes([8, 0x42, 0, 0]) + bytes([7, 1, 0, 3, 1, 2, 3]) + bytes([14, 1, 0, 3, 2]) + b"xy" + bytes([0, 2]))
# A longer session: files, an archive, execs with stdin, signals, windows and garbage together.
put("agent_server", "session", b"\x0b" + bytes([0, 0]) + bytes([9, 1]) + sw("f") + struct.pack("<H", 0o755) + s_data(3, 1, b"#!/bin/sh\n")
    + s_data(3, 1, b"") + bytes([11, 2]) + sw("t") + bytes([3]) + tar_entries + s_exec(3, 0x10) + s_data(2, 3, b"abc" * 20)
    + bytes([13, 6]) + b"SBX0zz" + s_window(3, 0) + bytes([4, 3, 28]) + WAIT + s_exec(4, 1, "word") + bytes([12, 5]) + sw("")
    + bytes([10, 6]) + sw("f") + s_exec(3, 0x10) + bytes([6, 3]) + s_exec(3, 0x10) + s_data(2, 3, b"") + WAIT + bytes([14, 2, 4, 2, 0]))
print("seeds written to", os.path.join(HERE, "seeds"))
