"""Stand-in for transformers' tests/models/llama/test_modeling_llama.py (not in the sdist): CausalLMModelTester's
dummy config and inputs for Llama (batch 13, 7 tokens, 2 layers of width 32, a lower-triangular attention mask),
under the sdist's ModelTesterMixin. The file's own Llama tests (rope scaling, the classification heads' shapes)
are not here; every ModelTesterMixin test is."""

import unittest

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
)
from transformers.testing_utils import require_torch, torch_device

from ...generation.test_utils import GenerationTesterMixin
from ...test_modeling_common import ModelTesterMixin, ids_tensor


class LlamaModelTester:
    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, use_input_mask=True, use_labels=True,
                 vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=37, hidden_act="gelu", max_position_embeddings=512, type_sequence_label_size=2,
                 initializer_range=0.02, num_labels=3, num_choices=4, pad_token_id=0, bos_token_id=1, eos_token_id=2):
        self.parent = parent
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        self.use_input_mask, self.use_labels = use_input_mask, use_labels
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.intermediate_size, self.hidden_act = intermediate_size, hidden_act
        self.max_position_embeddings, self.initializer_range = max_position_embeddings, initializer_range
        self.type_sequence_label_size, self.num_labels, self.num_choices = type_sequence_label_size, num_labels, num_choices
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id
        self.head_dim = hidden_size // num_attention_heads

    def get_config(self):
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, hidden_act=self.hidden_act, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, initializer_range=self.initializer_range,
            pad_token_id=self.pad_token_id, bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
            is_decoder=False,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = torch.tril(torch.ones_like(input_ids).to(torch_device)) if self.use_input_mask else None
        sequence_labels = token_labels = choice_labels = None
        if self.use_labels:
            sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
            token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
            choice_labels = ids_tensor([self.batch_size], self.num_choices)
        return self.get_config(), input_ids, None, input_mask, sequence_labels, token_labels, choice_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, _, input_mask, *_ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": input_mask}


@require_torch
class LlamaModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (LlamaModel, LlamaForCausalLM, LlamaForSequenceClassification, LlamaForQuestionAnswering,
                         LlamaForTokenClassification)
    model_split_percents = [0.5, 0.7, 0.8]

    def setUp(self):
        self.model_tester = LlamaModelTester(self)

    def test_model(self):
        config, input_ids, _, input_mask, *_ = self.model_tester.prepare_config_and_inputs()
        model = LlamaModel(config=config).to(torch_device).eval()
        model(input_ids, attention_mask=input_mask)
        result = model(input_ids)
        tester = self.model_tester
        self.assertEqual(result.last_hidden_state.shape, (tester.batch_size, tester.seq_length, tester.hidden_size))
