"""An HTTPS server that records webhook deliveries, for batchfleet's tests.

Prints "listening PORT" on stdout once it accepts connections, then appends
one JSON line per request to --log: the method, path, Authorization header
and body length. /redirect answers 302 to --redirect-to; /fail answers 503;
anything else 200. Serves until killed.
"""
import argparse
import http.server
import json
import ssl
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--redirect-to", default="https://127.0.0.1:1/")
    args = ap.parse_args()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n)
            with open(args.log, "a") as f:
                f.write(json.dumps({
                    "method": "POST",
                    "path": self.path,
                    "authorization": self.headers.get("Authorization"),
                    "length": len(body),
                }) + "\n")
            if self.path.startswith("/redirect"):
                self.send_response(302)
                self.send_header("Location", args.redirect_to)
            elif self.path.startswith("/fail"):
                self.send_response(503)
            else:
                self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.cert, args.key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print(f"listening {server.server_address[1]}", flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    main()
