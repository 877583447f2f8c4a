#!/usr/bin/python3
"""A one-name DNS server on loopback for deploy/scaleout-test.sh: stands in for a Kubernetes
headless Service, whose name resolves to every ready replica.

    dns.py --port-file FILE --name attnserve.test --addresses FILE

Answers A queries for --name with the IPv4 addresses listed in --addresses (one per line), read
again at every query with TTL 0, so the test "adds a replica" by appending a line. Every other
query gets an empty NOERROR answer (AAAA, gRPC's TXT service-config lookup) or NXDOMAIN. UDP
only: the answers are small. Binds 127.0.0.1 on a free port, written to --port-file. Exits when
its parent (the test script) is gone, so it cannot outlive the test.
"""
import argparse
import os
import socket
import struct


def parse_question(packet):
    """(id, flags, name, qtype, end offset of the question) of a query packet."""
    query_id, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if qdcount != 1:
        raise ValueError("one question expected")
    labels, pos = [], 12
    while packet[pos]:
        length = packet[pos]
        labels.append(packet[pos + 1:pos + 1 + length].decode("ascii").lower())
        pos += 1 + length
    qtype, _qclass = struct.unpack("!HH", packet[pos + 1:pos + 5])
    return query_id, flags, ".".join(labels), qtype, pos + 5


def answer(packet, name, addresses_file):
    """The reply packet to one query."""
    query_id, flags, qname, qtype, end = parse_question(packet)
    question = packet[12:end]
    records = []
    if qname == name and qtype == 1:  # A
        with open(addresses_file) as f:
            for line in f:
                if line.strip():
                    records.append(struct.pack("!HHHIH", 0xC00C, 1, 1, 0, 4) +
                                   socket.inet_aton(line.strip()))
    rcode = 0 if qname == name else 3  # NXDOMAIN for any other name
    reply_flags = 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | rcode  # QR AA RD RA
    header = struct.pack("!HHHHHH", query_id, reply_flags, 1, len(records), 0, 0)
    return header + question + b"".join(records)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--addresses", required=True)
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(1.0)
    with open(args.port_file + ".tmp", "w") as f:
        f.write(f"{sock.getsockname()[1]}\n")
    os.rename(args.port_file + ".tmp", args.port_file)
    parent = os.getppid()
    while os.getppid() == parent:
        try:
            packet, peer = sock.recvfrom(4096)
        except socket.timeout:
            continue
        try:
            sock.sendto(answer(packet, args.name.lower(), args.addresses), peer)
        except (ValueError, IndexError, struct.error, UnicodeDecodeError):
            pass  # not a query we understand: no answer, the resolver times out


if __name__ == "__main__":
    main()
