"""Retrieval for searchqa: a built-in BM25 retriever (bm25s), a client for Search-R1-compatible
retrieval servers, and a small server exposing any retriever through that same API.

API (Search-R1 ``retrieval_server.py``): ``POST /retrieve`` with ``{"queries": [...], "topk": k,
"return_scores": bool}`` → ``{"result": [[{"document": {"id", "contents"}, "score": s}, ...]]}``
(plain documents when ``return_scores`` is false). Unknown fields are ignored."""

from __future__ import annotations

import http.server
import json
import sys
import threading
import urllib.request
from typing import Any, Protocol


class Retriever(Protocol):
    def retrieve(self, queries: list[str], k: int) -> list[list[tuple[dict[str, str], float]]]: ...


def split_contents(contents: str) -> tuple[str, str]:
    """wiki-18 layout: the first line is the quoted title, the rest the text."""
    first, _, rest = contents.partition("\n")
    return first.strip().strip('"'), rest.strip()


def _import_bm25s() -> Any:
    """bm25s picks jax for top-k when it can import it; harness/ stays jax-free (and a test
    process skips seconds of jax start-up), so jax is hidden while bm25s loads unless the process
    already has it."""
    if "jax" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["jax"] = None  # type: ignore[assignment]  # makes `import jax` raise ImportError
    try:
        import bm25s
    finally:
        del sys.modules["jax"]
    return bm25s


class BM25Retriever:
    def __init__(self, docs: list[dict[str, str]]):
        bm25s = _import_bm25s()

        if not docs:
            raise ValueError("empty corpus")
        self.docs = docs
        self._bm25s = bm25s
        self._index = bm25s.BM25()
        corpus_tokens = bm25s.tokenize(
            [d["contents"] for d in docs], stopwords="en", show_progress=False
        )
        self._index.index(corpus_tokens, show_progress=False)
        self._lock = threading.Lock()

    def retrieve(self, queries: list[str], k: int) -> list[list[tuple[dict[str, str], float]]]:
        k = max(1, min(k, len(self.docs)))
        tokens = self._bm25s.tokenize(queries, stopwords="en", show_progress=False)
        with self._lock:
            idx, scores = self._index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [
            [(self.docs[int(i)], float(s)) for i, s in zip(row_i, row_s, strict=True)]
            for row_i, row_s in zip(idx, scores, strict=True)
        ]


class HTTPRetriever:
    """Client of a Search-R1-compatible server (``url`` ends with /retrieve)."""

    def __init__(self, url: str, timeout_s: float = 30.0):
        self.url = url
        self.timeout_s = timeout_s

    def retrieve(self, queries: list[str], k: int) -> list[list[tuple[dict[str, str], float]]]:
        body = json.dumps({"queries": queries, "topk": k, "return_scores": True}).encode()
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            data = json.loads(resp.read(16 << 20))
        out = []
        for row in data["result"]:
            hits = []
            for hit in row:
                if isinstance(hit, dict) and "document" in hit:
                    hits.append((hit["document"], float(hit.get("score", 0.0))))
                else:
                    hits.append((hit, 0.0))
            out.append(hits)
        return out


def serve(
    retriever: Retriever, host: str = "127.0.0.1", port: int = 0
) -> http.server.ThreadingHTTPServer:
    """Serve ``retriever`` at http://host:port/retrieve from a thread; ``shutdown()`` ends it."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/retrieve":
                self.send_error(404)
                return
            try:
                n = int(self.headers.get("Content-Length", "0"))
                req = json.loads(self.rfile.read(min(n, 1 << 20)))
                queries = [str(q) for q in req["queries"]]
                k = int(req.get("topk") or 3)
            except (ValueError, KeyError, TypeError):
                self.send_error(400, "expected {'queries': [...], 'topk': k}")
                return
            results = retriever.retrieve(queries, k)
            scores = bool(req.get("return_scores", False))
            payload: dict[str, Any] = {
                "result": [
                    [{"document": d, "score": s} if scores else d for d, s in row]
                    for row in results
                ]
            }
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
    ).start()
    return server
