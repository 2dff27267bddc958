"""Stand-ins for peers' test files, used only where neither the peer's sdist nor its repository supplied the file.

Each is copied into the peer's test tree under the file name it stands in for, so its relative imports are the
tree's (`from ...test_modeling_common import ModelTesterMixin`): a tester's dummy config and inputs under the
sdist's own, exact-version mixin. `peer_suites.py` records which files of a run were stand-ins."""
