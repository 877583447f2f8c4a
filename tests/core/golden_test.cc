// Golden tests: Layer::Forward against the PyTorch fixtures of tests/fixtures.
#include "gtest/gtest.h"
#include "tests/common/golden.h"
