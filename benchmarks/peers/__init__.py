"""What `benchmarks/peer_suites.py` brings to the peers' test trees: the pytest plugin that routes every model a test
builds (`plugin.py`), and stand-ins for the test files a tree lacks where its repository cannot be reached
(`standins/`, copied in under the peer's own file names)."""
