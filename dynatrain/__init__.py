"""DynaTrain: live parallel-layout switching for Megatron-core training."""
