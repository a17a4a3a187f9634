// Emulator stand-in: __half comes from cuda_emu.h.
#pragma once
