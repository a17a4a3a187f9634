// Emulator stand-in: __nv_bfloat16 comes from cuda_emu.h.
#pragma once
