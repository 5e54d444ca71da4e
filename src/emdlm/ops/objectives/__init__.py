"""The per-chunk objectives of the chunk engine (:mod:`emdlm.ops.chunked`), one module per
family: :mod:`~emdlm.ops.objectives.ce` (CE, TaiLr, MixCE, DFT), :mod:`~.ntil` (NTIL, digit
EMD), :mod:`~.ntl` (the NTL losses), :mod:`~.emo` (EMO) and :mod:`~.emo_distill` (EMO
distillation and the CE + KL baseline); :mod:`~.candidates` is what the number objectives
share."""
