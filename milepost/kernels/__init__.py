"""GPU kernels (Triton): the engine's (fused_ops, paged_attention) and the trainer's, with backward
(train_fused, fused_logprob); each has a torch reference path it is tested against."""
