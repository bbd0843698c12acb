"""geoattn.algebra"""
