// Precompiled header shared by every LibTorch-using target (see roundpipe_use_pch).
#pragma once
#include <torch/torch.h>
