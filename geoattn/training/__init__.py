"""geoattn.training"""
