"""Stand-in for transformers' tests/exporters/test_export.py (not in the sdist): an empty ExportTesterMixin, the base
of ModelTesterMixin. Its torch.export / ONNX / ExecuTorch tests do not run where this stands in."""


class ExportTesterMixin:
    pass
