"""Gradient distribution analysis: how Laplacian are gradients and residuals?"""

from jaxcomp.analysis.distributions import EMD_BINS, FAMILIES, fit_distances, tree_fit_distances

__all__ = ["EMD_BINS", "FAMILIES", "fit_distances", "tree_fit_distances"]
