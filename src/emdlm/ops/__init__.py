"""Fast paths (custom autograd, chunked, fused linear); each is tested equal to emdlm.functional."""
