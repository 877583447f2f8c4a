#!/usr/bin/python3
"""A real HTTP server (Python's http.server) standing in for attnserve's /metrics in the load
tester's tests: the Nth GET of /metrics answers the Nth --exposition file (the last one again
after that), so a test knows exactly what a run's before and after scrapes saw.
Same command line as attnserve's start: --listen HOST:PORT --port-file FILE (and
--metrics-listen, accepted and ignored: the stub serves /metrics on --listen)."""
import argparse
import http.server
import pathlib


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--metrics-listen")
    parser.add_argument("--http-listen")  # ServerProcess turns attnserve's REST port off
    parser.add_argument("--exposition", action="append", required=True)
    args = parser.parse_args()
    bodies = [pathlib.Path(p).read_bytes() for p in args.exposition]
    served = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = bodies[min(served[0], len(bodies) - 1)]
            served[0] += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *unused):
            pass

    host, port = args.listen.rsplit(":", 1)
    server = http.server.ThreadingHTTPServer((host, int(port)), Handler)
    pathlib.Path(args.port_file).write_text(f"{server.server_address[1]}\n")
    server.serve_forever()


if __name__ == "__main__":
    main()
