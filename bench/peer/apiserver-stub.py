# Minimal HTTP kube-apiserver stand-in for dra-example-kubeletplugin.
# Usage: python3 apiserver-stub.py PORT [DRIVER_NAME]. Logs every request to stdout.
# Serves: watch-list/list of resource.k8s.io/v1 resourceslices (empty + initial-events-end bookmark),
# GET /api/v1/nodes/node1, POST resourceslices (protobuf body ignored; minimal JSON reply),
# GET resource.k8s.io/v1 resourceclaims/<name> (uid "uid-<name>", allocated gpu-0 from pool node1).
import json, sys, time, threading
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
NODE = "node1"
DRIVER = sys.argv[2] if len(sys.argv) > 2 else "gpu.example.com"
CNT = 0
def claim(ns, name):
    return {"apiVersion":"resource.k8s.io/v1","kind":"ResourceClaim",
      "metadata":{"name":name,"namespace":ns,"uid":"uid-"+name,"resourceVersion":"5"},
      "spec":{"devices":{"requests":[{"name":"gpu","exactly":{"deviceClassName":"gpu.example.com"}}]}},
      "status":{"allocation":{"devices":{"results":[{"request":"gpu","driver":DRIVER,"pool":NODE,"device":"gpu-0"}]}}}}
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def send(self, code, obj):
        b = json.dumps(obj).encode()
        # single write: avoids Nagle/delayed-ACK 40 ms stalls
        h = ("HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (code, len(b))).encode()
        self.wfile.write(h + b); self.wfile.flush()
    def handle_any(self):
        n = int(self.headers.get("Content-Length") or 0); body = self.rfile.read(n) if n else b""
        print(f"{time.time():.3f} {self.command} {self.path} accept={self.headers.get('Accept')} ct={self.headers.get('Content-Type')} len={n}", flush=True)
        p = self.path.split("?")[0]; q = self.path.split("?")[1] if "?" in self.path else ""
        if p == f"/api/v1/nodes/{NODE}":
            return self.send(200, {"apiVersion":"v1","kind":"Node","metadata":{"name":NODE,"uid":"node-uid-1","resourceVersion":"1"}})
        if p == "/apis/resource.k8s.io/v1/resourceslices":
            if self.command == "POST":
                # body is protobuf (client-go default); answer with a minimal JSON object
                global CNT; CNT += 1
                return self.send(201, {"apiVersion":"resource.k8s.io/v1","kind":"ResourceSlice","metadata":{"name":"slice-%d"%CNT,"uid":"slice-uid-%d"%CNT,"resourceVersion":str(10+CNT)},"spec":{"driver":DRIVER,"nodeName":NODE,"pool":{"name":NODE,"generation":1,"resourceSliceCount":1}}})
            if "watch=true" in q or "watch=1" in q:
                self.send_response(200); self.send_header("Content-Type","application/json")
                self.send_header("Transfer-Encoding","chunked"); self.end_headers(); self.wfile.flush()
                try:
                    if "sendInitialEvents=true" in q:
                        ev = json.dumps({"type":"BOOKMARK","object":{"apiVersion":"resource.k8s.io/v1","kind":"ResourceSlice","metadata":{"resourceVersion":"1","annotations":{"k8s.io/initial-events-end":"true"}}}}).encode()+b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev)); self.wfile.flush()
                    time.sleep(3600)
                except Exception: pass
                return
            return self.send(200, {"apiVersion":"resource.k8s.io/v1","kind":"ResourceSliceList","metadata":{"resourceVersion":"1"},"items":[]})
        parts = p.split("/")
        if len(parts) == 8 and parts[1:4] == ["apis","resource.k8s.io","v1"] and parts[6] == "resourceclaims" and self.command == "GET":
            return self.send(200, claim(parts[5], parts[7]))
        return self.send(404, {"apiVersion":"v1","kind":"Status","status":"Failure","reason":"NotFound","code":404,"message":"not found"})
    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = handle_any
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
