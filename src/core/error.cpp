// Out-of-line anchor for the error header (keeps one translation unit owning the vtable of Error).
#include "core/error.h"
