"""Stand-in for transformers' tests/models/vit/test_modeling_vit.py (not in the sdist): ViTModelTester's dummy
config and inputs (batch 13 of 30×30 images, patch 2: 226 tokens with [CLS]; 2 layers of width 32, eager attention)
and the test class's own overrides, under the sdist's ModelTesterMixin."""

import unittest

from torch import nn
from transformers import ViTConfig, ViTForImageClassification, ViTForMaskedImageModeling, ViTModel
from transformers.testing_utils import require_torch, torch_device

from ...test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor


class ViTModelTester:
    def __init__(self, parent, batch_size=13, image_size=30, patch_size=2, num_channels=3, is_training=True,
                 use_labels=True, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                 hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                 type_sequence_label_size=10, initializer_range=0.02, encoder_stride=2, mask_ratio=0.5,
                 attn_implementation="eager"):
        self.parent = parent
        self.batch_size, self.image_size, self.patch_size = batch_size, image_size, patch_size
        self.num_channels, self.is_training, self.use_labels = num_channels, is_training, use_labels
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_attention_heads, self.intermediate_size = num_attention_heads, intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob, self.attention_probs_dropout_prob = hidden_dropout_prob, attention_probs_dropout_prob
        self.type_sequence_label_size, self.initializer_range = type_sequence_label_size, initializer_range
        self.encoder_stride, self.attn_implementation = encoder_stride, attn_implementation
        num_patches = (image_size // patch_size) ** 2
        self.seq_length = num_patches + 1  # the [CLS] token
        self.mask_ratio, self.num_masks, self.mask_length = mask_ratio, int(mask_ratio * self.seq_length), num_patches

    def get_config(self):
        return ViTConfig(
            image_size=self.image_size, patch_size=self.patch_size, num_channels=self.num_channels,
            hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act, hidden_dropout_prob=self.hidden_dropout_prob,
            attention_probs_dropout_prob=self.attention_probs_dropout_prob, is_decoder=False,
            initializer_range=self.initializer_range, encoder_stride=self.encoder_stride,
            attn_implementation=self.attn_implementation,
        )

    def prepare_config_and_inputs(self):
        pixel_values = floats_tensor([self.batch_size, self.num_channels, self.image_size, self.image_size])
        labels = ids_tensor([self.batch_size], self.type_sequence_label_size) if self.use_labels else None
        return self.get_config(), pixel_values, labels

    def prepare_config_and_inputs_for_common(self):
        config, pixel_values, _ = self.prepare_config_and_inputs()
        return config, {"pixel_values": pixel_values}


@require_torch
class ViTModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (ViTModel, ViTForImageClassification, ViTForMaskedImageModeling)
    test_resize_embeddings = False
    test_torch_exportable = True

    def setUp(self):
        self.model_tester = ViTModelTester(self)

    @unittest.skip(reason="ViT does not use inputs_embeds")
    def test_inputs_embeds(self):
        pass

    def test_model_get_set_embeddings(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config)
            self.assertIsInstance(model.get_input_embeddings(), nn.Module)
            x = model.get_output_embeddings()
            self.assertTrue(x is None or isinstance(x, nn.Linear))

    def test_model(self):
        config, pixel_values, _ = self.model_tester.prepare_config_and_inputs()
        model = ViTModel(config=config).to(torch_device).eval()
        result = model(pixel_values)
        tester = self.model_tester
        self.assertEqual(result.last_hidden_state.shape, (tester.batch_size, tester.seq_length, tester.hidden_size))
