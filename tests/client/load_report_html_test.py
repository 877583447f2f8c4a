#!/usr/bin/python3
"""The load tester's HTML report in a real browser: runs `attnserve-client bench` (a rate sweep)
against a real attnserve on loopback with --html, then renders the page with Debian's headless
chromium. The page must fetch nothing, its script must mark its three charts drawn
(data-charts-drawn="3" in the DOM after scripts ran), the charts must hold their lines and bars,
and the screenshot must show them: many non-white pixels, in the charts' colours.
Exit 0 on success; a message and exit 1 otherwise."""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def start_server(binary, workdir):
    port_file = os.path.join(workdir, "port")
    log = open(os.path.join(workdir, "server.log"), "w")
    server = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--port-file", port_file,
                               "--threads", "2", "--log-level", "warn", "--metrics-listen=off"],
                              stdout=log, stderr=log)
    deadline = time.time() + 60
    while time.time() < deadline:
        if os.path.exists(port_file):
            text = open(port_file).read()
            if text.endswith("\n"):
                return server, f"127.0.0.1:{text.strip()}"
        if server.poll() is not None:
            fail("attnserve exited at start")
        time.sleep(0.05)
    server.kill()
    fail("attnserve wrote no port")


def decode_png(data):
    """Pixels of an 8-bit RGB or RGBA, non-interlaced PNG as (width, height, rows of RGB tuples)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail("the screenshot is not a PNG")
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in (2, 6) or interlace:
        fail(f"unexpected PNG format: depth {depth}, colour type {colour}, interlace {interlace}")
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        line = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        kind, cur = line[0], bytearray(line[1:])
        for i in range(stride):
            a = cur[i - channels] if i >= channels else 0
            b = previous[i]
            c = previous[i - channels] if i >= channels else 0
            if kind == 1:
                cur[i] = (cur[i] + a) & 255
            elif kind == 2:
                cur[i] = (cur[i] + b) & 255
            elif kind == 3:
                cur[i] = (cur[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append([tuple(cur[x * channels:x * channels + 3]) for x in range(width)])
        previous = cur
    return width, height, rows


def chromium(args, workdir):
    """Headless chromium that writes only under workdir: its profile (--user-data-dir), and
    what it keeps beside the profile (crashpad's settings in $XDG_CONFIG_HOME/chromium, dconf's
    cache in $XDG_CACHE_HOME) in a home of its own."""
    home = os.path.join(workdir, "home")
    env = dict(os.environ, HOME=home, XDG_CONFIG_HOME=os.path.join(home, ".config"),
               XDG_CACHE_HOME=os.path.join(home, ".cache"),
               XDG_DATA_HOME=os.path.join(home, ".local", "share"))
    base = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--disable-background-networking", "--no-first-run", "--disable-breakpad",
            "--disable-crash-reporter", f"--user-data-dir={os.path.join(workdir, 'profile')}"]
    return subprocess.run(base + args, capture_output=True, text=True, timeout=120, env=env)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--client", required=True)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="attnserve-html-")
    server, target = start_server(args.server, workdir)
    try:
        html = os.path.join(workdir, "report.html")
        run = subprocess.run([args.client, "--target", target, "bench", "--random", "1,16",
                              "--rate-range", "100:400:x2", "--duration", "0.5",
                              "--warmup-seconds", "0", "--html", html, "--json"],
                             capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            fail(f"bench exited {run.returncode}: {run.stderr}")
        report = json.loads(run.stdout)
        if len(report["steps"]) != 3:
            fail(f"expected 3 sweep steps, got {len(report['steps'])}")
    finally:
        server.terminate()
        server.wait(timeout=30)

    page = open(html).read()
    for fetch in (r"<script[^>]+src=", r"<link", r"<img", r"@import", r"url\(", r"fetch\(",
                  r"XMLHttpRequest", r"<iframe"):
        if re.search(fetch, page, re.IGNORECASE):
            fail(f"the page is not self-contained: it matches {fetch}")

    dom = chromium(["--virtual-time-budget=5000", "--dump-dom", f"file://{html}"], workdir)
    if 'data-charts-drawn="3"' not in dom.stdout:
        fail(f"the page's script did not mark its charts drawn:\n{dom.stdout[:2000]}\n{dom.stderr}")
    for chart in ("curve", "time", "hist"):
        svg = re.search(rf'<svg id="{chart}".*?</svg>', dom.stdout, re.DOTALL)
        if not svg:
            fail(f"no chart {chart} in the rendered page")
        marks = len(re.findall(r"<polyline|<rect", svg.group(0)))
        if marks < 3:
            fail(f"chart {chart} holds {marks} lines or bars")
    # The sweep's 3 steps appear as 4 polylines of 3 points each (p50, p90, p99, p99.9).
    curve = re.search(r'<svg id="curve".*?</svg>', dom.stdout, re.DOTALL).group(0)
    lines = re.findall(r'<polyline points="([^"]*)"', curve)
    if len(lines) != 4 or any(len(points.split()) != 3 for points in lines):
        fail(f"the latency-throughput curve is not 4 lines of 3 steps: {lines}")

    png = os.path.join(workdir, "report.png")
    shot = chromium(["--virtual-time-budget=5000", f"--screenshot={png}",
                     "--window-size=1400,900", f"file://{html}"], workdir)
    if not os.path.exists(png):
        fail(f"chromium wrote no screenshot: {shot.stderr}")
    width, height, rows = decode_png(open(png, "rb").read())
    pixels = [p for row in rows for p in row]
    non_white = sum(1 for p in pixels if p != (255, 255, 255))
    blue = sum(1 for p in pixels if abs(p[0] - 31) < 12 and abs(p[1] - 119) < 12 and abs(p[2] - 180) < 12)
    red = sum(1 for p in pixels if abs(p[0] - 214) < 12 and abs(p[1] - 39) < 12 and abs(p[2] - 40) < 12)
    print(f"screenshot {width}x{height}: {non_white} non-white pixels, {blue} chart blue, {red} p99 red")
    if non_white < 0.03 * len(pixels):
        fail("the screenshot is nearly blank")
    if blue < 2000 or red < 100:
        fail("the screenshot does not show the charts' lines and bars")
    shutil.rmtree(workdir, ignore_errors=True)
    print("OK")


if __name__ == "__main__":
    main()
