"""GPU kernels (Triton) used by the engine; each has a torch reference path it is tested against."""
