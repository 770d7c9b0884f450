"""fastpipe's benchmarks. Run as ``python -m bench``; nothing runs at import."""
