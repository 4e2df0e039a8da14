"""refimpl.gradcheck: central differences and the relative error used by every gradient check."""

import numpy as np
import pytest

from refimpl.gradcheck import numerical_gradient, relative_error


def test_central_differences_of_a_known_gradient():
    x = np.array([[0.3, -1.2], [2.0, 0.5]])
    # L = sum(sin(x) * x^2): dL/dx = cos(x) x^2 + 2 x sin(x)
    loss = lambda a: np.sum(np.sin(a) * a**2)  # noqa: E731
    fd = numerical_gradient(loss, x)
    # rounding: each loss carries ~ eps * sum|terms|, divided by 2h; truncation h^2 |L'''| / 6 ~ 1e-12
    atol = 2 * np.finfo(float).eps * np.sum(np.abs(np.sin(x) * x**2)) / (2 * 1e-6) + 1e-11
    np.testing.assert_allclose(fd, np.cos(x) * x**2 + 2 * x * np.sin(x), rtol=0, atol=atol)


def test_exact_for_quadratics_up_to_rounding_and_input_untouched():
    x = np.array([1.0, -2.0, 3.0])
    before = x.copy()
    fd = numerical_gradient(lambda a: float(a @ a), x, h=1e-3)  # central differences are exact on quadratics
    np.testing.assert_allclose(fd, 2 * x, rtol=1e-10)
    np.testing.assert_array_equal(x, before)


def test_relative_error():
    assert relative_error(np.array([1.0, 2.0]), np.array([1.0, 2.5])) == pytest.approx(0.2)
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match="h: expected a finite number > 0"):
        numerical_gradient(np.sum, np.ones(2), h=0.0)
