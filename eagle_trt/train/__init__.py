"""Drafter training: conversations -> cached target features -> draft vocabulary ->
training-time-test (TTT) training -> a SafeAILab-layout checkpoint. CLI: python -m eagle_trt.train."""
from .data import DataConfig, MTBenchGuard, Sample, load_samples
from .features import FeatureConfig, FeatureStore, extract_features
from .ttt import TrainConfig, collate, new_drafter, train, ttt_forward
from .vocab import DraftVocab, build_draft_vocab, count_tokens

__all__ = ["DataConfig", "DraftVocab", "FeatureConfig", "FeatureStore", "MTBenchGuard", "Sample", "TrainConfig",
           "build_draft_vocab", "collate", "count_tokens", "extract_features", "load_samples", "new_drafter",
           "train", "ttt_forward"]
