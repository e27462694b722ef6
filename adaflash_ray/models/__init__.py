"""Models: the target (Llama/Qwen2/Qwen3 with feature capture), the DFlash drafter, length heads,
and the DFlash checkpoint format. No Ray imports here."""
from adaflash_ray.models.checkpoint import (CheckpointError, load_drafter_checkpoint, save_drafter_checkpoint,
                                            tensors_sha256)
from adaflash_ray.models.drafter import DFlashDrafter, DrafterModelConfig
from adaflash_ray.models.length_head import (AcceptanceHead, DirectLengthHead, acceptance_labels, direct_length_label,
                                             draft_confidence, expected_committed, ratio_to_draft_len)
from adaflash_ray.models.target import KVCache, TargetConfig, TargetModel, TargetOutput, default_target_layer_ids

__all__ = ["CheckpointError", "load_drafter_checkpoint", "save_drafter_checkpoint", "tensors_sha256",
           "DFlashDrafter", "DrafterModelConfig", "AcceptanceHead", "DirectLengthHead", "acceptance_labels",
           "direct_length_label", "draft_confidence", "expected_committed", "ratio_to_draft_len",
           "KVCache", "TargetConfig", "TargetModel", "TargetOutput", "default_target_layer_ids"]
