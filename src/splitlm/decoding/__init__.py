"""Decoding on the edge: drafters, token trees and their masks, greedy verification, step budgets."""
