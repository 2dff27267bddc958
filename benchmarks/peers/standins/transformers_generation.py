"""Stand-in for transformers' tests/generation/test_utils.py (not in the sdist): an empty GenerationTesterMixin, so
test_modeling_common imports. No generate() tests run; ModelTesterMixin's own tests are all there."""


class GenerationTesterMixin:
    pass
