"""k3ckpt: inspect, requantize and place the experts of very large MXFP4 MoE checkpoints."""

__version__ = "0.1.0"
