"""A registry that streams 500 MB bodies with no Content-Length, for measuring the agent's
peak RSS under attack (BENCHMARKS.md, "Memory under a hostile registry"). Usage:
python3 bench/hostile/registry.py PORT MODE, MODE one of: manifest (200 and a 500 MB manifest),
error (404 and a 500 MB body), token (a bearer challenge whose token service answers 500 MB).
"""
import http.server, sys
mode = sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, *a): pass
    def do_GET(self):
        if mode == "token" and "Authorization" not in self.headers and not self.path.startswith("/token"):
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Bearer realm="http://127.0.0.1:%s/token",service="x"' % sys.argv[1])
            self.end_headers(); return
        code = 404 if mode == "error" else 200
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        chunk = b"a" * 65536
        try:
            for _ in range(8000):  # ~500 MB, no Content-Length
                self.wfile.write(chunk)
        except Exception:
            pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
