"""Gradient distribution analysis: how Laplacian are gradients and residuals?"""

from jaxcomp.analysis.distributions import FAMILIES, fit_distances, tree_fit_distances

__all__ = ["FAMILIES", "fit_distances", "tree_fit_distances"]
